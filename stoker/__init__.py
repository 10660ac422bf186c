"""Stoker: one import namespace over the repository's packages.

    stoker.schemas   the wire contract (msgspec only)      stoker.client    producer client, CLI, load, demo
    stoker.engine    the inference engine (torch, Triton)  stoker.gateway   the OpenAI-compatible gateway
    stoker.worker    Kafka -> engine -> Redis              stoker.devstack  the local Kafka + Redis launcher

The folders stay at the top of the repository (schemas/, engine/, ...). Installed (`pip install .`),
setuptools' package-dir mapping puts them under stoker/ in the wheel, so nothing of ours takes a top-level
name a user's own module might have. Editable, setuptools' import finder maps each stoker.X to its folder.
In a plain source tree (`PYTHONPATH=<repo>`, nothing installed: the bench on a GPU machine) this folder
holds only this file, and the line below lets `import stoker.engine` find the sibling folder engine/.
Standard library only, and nothing else runs at import: `python3 -m stoker.devstack` needs no venv.
"""

from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "schemas" / "__init__.py").is_file() and (_here.parent / "schemas" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # a source tree: the packages are this folder's siblings
