"""One import namespace: installed, editable or from a plain source tree, our packages are stoker.schemas,
stoker.engine, ... and never take a top-level name (a user's own `schemas.py` or `client/` keeps its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_wheel_lists_every_package_folder():
    """setuptools takes the packages list as given: a new subpackage missing from it would be left out of
    the wheel (and work from the source tree only)."""
    found = {"stoker"}
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert set(SETUPTOOLS["packages"]) == found


def test_a_plain_source_tree_imports_the_stoker_names(tmp_path: Path):
    """PYTHONPATH=<repo>, nothing installed (the bench on a GPU machine): stoker/__init__.py reaches the folders."""
    code = ("import stoker.schemas, stoker.devstack.stack, stoker.worker.requests, sys; "
            "print(stoker.schemas.__file__); print(stoker.worker.requests.__file__)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(ROOT / "schemas" / "__init__.py"), str(ROOT / "worker" / "requests.py")]


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    return uv


@pytest.mark.slow
def test_installed_next_to_a_users_schemas_and_client_neither_shadows_the_other(tmp_path: Path):
    """`pip install .` (here uv, offline from its cache) of the base package into a fresh venv; then, in a
    folder holding a user's `schemas.py` and `client/`, both the user's modules and ours import."""
    uv = _uv()
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, _mkdir(source) / name)
    for folder in ("stoker", *SETUPTOOLS["package-dir"].values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def uv_run(*args: str) -> None:
        run = subprocess.run([uv, *args], env=env, capture_output=True, text=True, timeout=600)
        if run.returncode != 0 and "offline" in run.stderr.lower():
            pytest.skip(f"uv's cache lacks what the install needs offline: {run.stderr[-300:]}")
        assert run.returncode == 0, run.stderr

    uv_run("venv", "-q", "-p", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    uv_run("pip", "install", "-q", "--offline", "-p", python, "--no-deps", str(source))
    uv_run("pip", "install", "-q", "--offline", "-p", python, "msgspec", "aiokafka", "redis", "click", "tqdm")  # the base deps

    user = _mkdir(tmp_path / "user")
    (user / "schemas.py").write_text("WHOSE = 'the user'\n")
    _mkdir(user / "client")
    (user / "client" / "__init__.py").write_text("WHOSE = 'the user'\n")
    code = (
        "import schemas, client\n"
        "assert schemas.WHOSE == client.WHOSE == 'the user', (schemas, client)\n"
        "import stoker.schemas, stoker.client.client\n"
        "from stoker.schemas import Job\n"
        "from stoker.client.client import Client\n"
        "assert 'site-packages' in stoker.schemas.__file__ and 'site-packages' in stoker.client.client.__file__\n"
        "assert Job(request_id='a', prompt='p').prompt == 'p'\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('engine') is None and importlib.util.find_spec('worker') is None\n"
        "print('ok')\n"
    )
    run = subprocess.run([python, "-c", code], cwd=user, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    # The console script and the launcher run from the install too.
    cli = subprocess.run([str(venv / "bin" / "stoker"), "--help"], cwd=user, env=env, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0 and "submit" in cli.stdout, cli.stderr
    stack = subprocess.run([python, "-m", "stoker.devstack", "--help"], cwd=user, env=env, capture_output=True,
                           text=True, timeout=60)
    assert stack.returncode == 0 and "up" in stack.stdout, stack.stderr


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
