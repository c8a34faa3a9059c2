"""Where the dashboard's ``templates/`` and ``static/`` are, in a checkout and after ``pip install .``.

They live at the top of the repository, beside ``dashboard/``, and a checkout (or an editable install)
serves them from there. A wheel carries them as data files (``[tool.setuptools.data-files]`` in
pyproject.toml), which pip puts under ``<prefix>/share/finetune-kit/``: the venv or system prefix, the
user base for ``--user``, the folder itself for ``--target``. Each of those is a parent of the installed
``dashboard/`` package (site-packages is ``<prefix>/lib/pythonX.Y/site-packages``), so looking upward
finds them wherever pip put the package.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

INSTALLED = Path("share") / "finetune-kit"
# One file each that only this project has, so an unrelated templates/ folder is never taken for ours.
MARKERS = (Path("templates") / "base.html", Path("static") / "app.js")


def candidates(package: Path) -> list[Path]:
    """Folders that may hold templates/ and static/, the checkout first."""
    folders = []
    for base in package.parents[:4]:  # the checkout's root, or site-packages and the prefix above it
        folders += [base, base / INSTALLED]
    folders += [Path(sys.prefix) / INSTALLED, Path(site.getuserbase()) / INSTALLED]
    return folders


def asset_root(package: Path | None = None) -> Path:
    """The folder that holds ``templates/`` and ``static/``; a RuntimeError names where it looked."""
    package = package or Path(__file__).resolve().parent
    looked = candidates(package)
    for folder in looked:
        if all((folder / marker).is_file() for marker in MARKERS):
            return folder
    raise RuntimeError(
        "dashboard templates and static files not found; looked in " + ", ".join(map(str, looked))
    )
