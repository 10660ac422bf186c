#!/usr/bin/env python3
"""Rewrite imports of our packages from their old top-level names to the `stoker.` namespace.

    python3 ops/rename_imports.py [--check] [PATH ...]     (default: every tracked file it knows how to read)

The folders stay where they are (schemas/, engine/, worker/, client/, gateway/, devstack/); installed and
imported they are stoker.schemas, stoker.engine, ... (README, "One import namespace"). A branch written
before that move is fixed at merge by running this over its files, then `ruff check --fix --select I` to
re-sort the imports. What it rewrites, for each package P:

    from P[.sub] import x      ->  from stoker.P[.sub] import x
    import P  /  import P as y ->  from stoker import P  /  from stoker import P as y
    import P.sub as y          ->  import stoker.P.sub as y
    import P.sub               ->  import stoker.P.sub        (binds `stoker`, not `P`: reported, fix by hand)
    "P.sub[.attr][:Name]"      ->  "stoker.P.sub..."          (a quoted dotted path that names one of our
                                                              modules: importlib, monkeypatch, `-m` argv)
    -m P[.sub]                 ->  -m stoker.P[.sub]          (shell scripts, docs, YAML)

Files given by name are always read; the default set leaves out a file that says `rename-imports: skip-file`
(one showing old imports on purpose). Standard library only. --check rewrites nothing and exits 1 if any file would change (ops/lint runs it,
beside ruff's banned-api rule, which sees imports but not strings or shell lines).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "engine", "worker", "client", "gateway", "devstack")
_P = "|".join(PACKAGES)
_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".sh", ".cfg", ".ini"}
_SKIP = {"pyproject.toml"}  # its package map and contracts name the folders on purpose: edited by hand
_FILE_SUFFIXES = {"py", "pyi", "json", "toml", "md", "txt", "yml", "yaml", "log", "so", "cfg", "ini"}
_MARKER = "rename-imports: " + "skip-file"  # a file that shows old imports on purpose (its tests) says so

_FROM = re.compile(rf"^(\s*)from\s+({_P})((?:\.\w+)*)(\s+import\b)", re.M)
_IMPORT_TOP = re.compile(rf"^(\s*)import\s+({_P})(\s+as\s+\w+)?[ \t]*(#.*)?$", re.M)
_IMPORT_SUB_AS = re.compile(rf"^(\s*)import\s+({_P})((?:\.\w+)+)(\s+as\s+\w+)", re.M)
_IMPORT_SUB = re.compile(rf"^(\s*)import\s+({_P})((?:\.\w+)+)[ \t]*(#.*)?$", re.M)
_DASH_M = re.compile(rf"(-m\s+)({_P})(?=[.\s\"'`]|$)", re.M)
_QUOTED = re.compile(rf"([\"'])(({_P})(?:\.[A-Za-z_]\w*)+)(:[A-Za-z_]\w*)?\1")


def _is_module(dotted: str, root: Path) -> bool:
    """Whether `dotted` starts with a module or package of the tree ("engine.LLMEngine" names the engine
    package's attribute, as monkeypatch targets do)."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        base = root.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    # "package.name": only a name the package's __init__ defines or imports, never a file ("schemas.py").
    init = root / parts[0] / "__init__.py"
    return (parts[1] not in _FILE_SUFFIXES and init.is_file()
            and re.search(rf"\b{re.escape(parts[1])}\b", init.read_text()) is not None)


def rewrite(text: str, python: bool, root: Path = ROOT) -> tuple[str, list[str]]:
    """The text with our old top-level imports renamed, and warnings for lines to look at by hand."""
    warnings: list[str] = []
    text = _FROM.sub(r"\1from stoker.\2\3\4", text)
    text = _IMPORT_TOP.sub(lambda m: f"{m[1]}from stoker import {m[2]}{m[3] or ''}"
                                     f"{'  ' + m[4] if m[4] else ''}", text)
    text = _IMPORT_SUB_AS.sub(r"\1import stoker.\2\3\4", text)

    def sub_import(m: re.Match[str]) -> str:
        warnings.append(f"`import {m[2]}{m[3]}` now binds `stoker`: uses of `{m[2]}.` there need `stoker.{m[2]}.`")
        return f"{m[1]}import stoker.{m[2]}{m[3]}{'  ' + m[4] if m[4] else ''}"

    text = _IMPORT_SUB.sub(sub_import, text)
    text = _DASH_M.sub(r"\1stoker.\2", text)
    if python:
        text = _QUOTED.sub(lambda m: f"{m[1]}stoker.{m[2]}{m[4] or ''}{m[1]}" if _is_module(m[2], root) else m[0],
                           text)
    return text, warnings


def _default_paths(root: Path) -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    own = Path(__file__).resolve()
    out = []
    for name in listed.splitlines():
        path = root / name
        if path.resolve() == own or path.name in _SKIP or not path.is_file():
            continue
        shell = name.startswith("ops/") and path.suffix == "" and path.read_bytes()[:2] == b"#!"
        # the marker is read only from files of the kinds rewritten: a tracked binary (gzip data) is not text
        if (path.suffix in _SUFFIXES or shell or path.name == "Dockerfile") and _MARKER not in path.read_text():
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="files (default: the tracked ones it can read)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    paths = args.paths or _default_paths(ROOT)
    changed = []
    for path in paths:
        text = path.read_text()
        new, warnings = rewrite(text, python=path.suffix == ".py")
        for warning in warnings:
            print(f"{path}: {warning}", file=sys.stderr)
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    verb = "would rewrite" if args.check else "rewrote"
    for path in changed:
        print(f"{verb} {path}", file=sys.stderr)
    if args.check and changed:
        print("old top-level imports of our packages: run `python3 ops/rename_imports.py` on these files",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
