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
PACKAGES = ("schemas", "engine", "worker", "client", "gateway", "devstack")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    command = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    # PYTHONPATH=tree: the copy's packages, not an editable install of another checkout.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(command + ["--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


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
        "from engine.models.base import CausalLM\n",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from engine.model_runner import ModelRunner\n",
    )
    run = lint_imports(tree)
    assert run.returncode != 0
    out = run.stdout
    assert "No import cycles among the modules of any package BROKEN" in out
    assert "No cycles are allowed in engine." in out and ".models -> .model_runner" in out
    assert "engine.models is not allowed to import engine.model_runner" in out
    assert "engine.models.llama -> engine.model_runner" in out


def test_the_worker_reaching_past_the_public_engine_api_breaks_its_contract(tree: Path) -> None:
    inject(tree / "worker/driver.py", "from engine import EngineRequest, EngineStats, RequestOutput\n",
           "from engine.sequence import Sequence  # noqa: F401\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "worker uses only the engine's public names (from engine import ...) BROKEN" in run.stdout
    assert "worker.driver -> engine.sequence" in run.stdout


def test_torch_in_the_wire_schemas_breaks_its_contract(tree: Path) -> None:
    inject(tree / "schemas/messages.py", "import math\n", "import torch  # noqa: F401\n")
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "schemas.messages -> torch" in run.stdout
