#!/usr/bin/env python3
"""Lay out the packages as installed (DIR/stoker/schemas, DIR/stoker/engine, ...) for the tools that read
folders rather than import: mypy and lint-imports (grimp) map module names from paths and know nothing of
stoker/__init__.py's source-tree path or setuptools' package-dir mapping.

    python3 ops/namespace_view.py DIR [--copy]     (prints DIR; ops/lint runs it)

DIR/stoker/__init__.py is a copy of ours; each package folder is a symbolic link to the repository's (so a
tool's messages name files a person can open through it), or with --copy a copy (to edit in a test).
The mapping is read from pyproject.toml's [tool.setuptools.package-dir]: one source of truth.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """{"stoker.schemas": "schemas", ...} from pyproject.toml."""
    with open(root / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def make_view(dest: Path, copy: bool = False, root: Path = ROOT) -> Path:
    namespace = dest / "stoker"
    if namespace.exists():
        shutil.rmtree(namespace)
    namespace.mkdir(parents=True)
    shutil.copy(root / "stoker" / "__init__.py", namespace / "__init__.py")
    for package, folder in package_dirs(root).items():
        target = dest.joinpath(*package.split("."))
        if copy:
            shutil.copytree(root / folder, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.symlink_to(root / folder, target_is_directory=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--copy", action="store_true", help="copy the folders instead of linking them")
    args = parser.parse_args(argv)
    print(make_view(args.dest.resolve(), copy=args.copy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
