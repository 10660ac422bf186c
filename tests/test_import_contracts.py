"""The import contracts of pyproject.toml ([tool.importlinter], run by ops/lint) hold on the tree and catch a
violation: a temp copy of the packages with one forbidden import injected makes lint-imports fail and name it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    command = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    # PYTHONPATH=tree: the copy's packages, not an editable install of another checkout.
    env = {**os.environ, "PYTHONPATH": str(tree.parent)}
    return subprocess.run(command + ["--no-cache"], cwd=tree.parent, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the packages laid out as installed (tmp/stoker/engine, ...), as ops/lint checks them."""
    subprocess.run([sys.executable, str(ROOT / "ops" / "namespace_view.py"), str(tmp_path), "--copy"], check=True,
                   capture_output=True, timeout=60)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "stoker"


def inject(path: Path, after: str, lines: str) -> None:
    text = path.read_text()
    assert after in text, f"{path}: anchor {after!r} not found"
    path.write_text(text.replace(after, after + lines, 1))


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    run = lint_imports(tree)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_type_checking_import_of_the_runner_by_the_model_breaks_two_contracts(tree: Path) -> None:
    # The cycle this layout removed: the model importing the runner (for types) that imports the model.
    inject(
        tree / "engine/models/llama.py",
        "from stoker.engine.models.base import CausalLM\n",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from stoker.engine.model_runner import ModelRunner\n",
    )
    run = lint_imports(tree)
    assert run.returncode != 0
    out = run.stdout
    assert "No import cycles among the modules of any package BROKEN" in out
    assert "No cycles are allowed in stoker.engine." in out and ".models -> .model_runner" in out
    assert "stoker.engine.models is not allowed to import stoker.engine.model_runner" in out
    assert "stoker.engine.models.llama -> stoker.engine.model_runner" in out


def test_the_worker_reaching_past_the_public_engine_api_breaks_its_contract(tree: Path) -> None:
    # (anchored on the module's logger line: its import lines change as the driver uses more of the engine's API)
    inject(tree / "worker/driver.py", 'log = logging.getLogger("stoker.worker.driver")\n',
           "from stoker.engine.sequence import Sequence  # noqa: F401,E402\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "worker uses only the engine's public names (from stoker.engine import ...) BROKEN" in run.stdout
    assert "stoker.worker.driver -> stoker.engine.sequence" in run.stdout


def test_torch_in_the_wire_schemas_breaks_its_contract(tree: Path) -> None:
    inject(tree / "schemas/messages.py", "import math\n", "import torch  # noqa: F401\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "stoker.schemas.messages -> torch" in run.stdout


def test_the_launcher_importing_msgspec_breaks_its_contract(tree: Path) -> None:
    inject(tree / "devstack/kafka_wire.py", "import time\n", "import msgspec  # noqa: F401\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "the local-stack launcher needs nothing beyond the standard library" in run.stdout
    assert "stoker.devstack.kafka_wire -> msgspec" in run.stdout


def test_the_gateway_importing_the_engine_breaks_its_contract(tree: Path) -> None:
    inject(tree / "gateway/mapping.py", "import msgspec\n", "from stoker.engine import SamplingParams  # noqa: F401\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "stoker.gateway.mapping -> stoker.engine" in run.stdout
