"""Every package folder is listed in pyproject.toml: a folder left out installs fine with `pip install -e`
but is missing from `pip install .` (localllm.loading was, and the README's first command failed)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                assert ".".join((name, *parts)) in listed, (
                    f"{'.'.join((name, *parts))} is not in pyproject.toml"
                )
