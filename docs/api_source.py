"""MkDocs hook: the package's source laid out as it is installed, for the API reference.

The install maps `backends/` to `compcomm.backends` (`[tool.setuptools.package-dir]`), but
mkdocstrings reads sources by folder, where `compcomm/backends` does not exist. Before each build
this hook makes `build/docs-api/compcomm/`: links to every entry of `compcomm/` plus `backends`
linked to `backends/`, which mkdocs.yml gives mkdocstrings as its search path.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority


@event_priority(100)  # before mkdocstrings reads its search paths, which must exist by then
def on_config(config: Any) -> Any:
    root = Path(config.config_file_path).resolve().parent
    package = root / "build" / "docs-api" / "compcomm"
    shutil.rmtree(package.parent, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (root / "compcomm").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "backends").symlink_to(root / "backends")
    return config
