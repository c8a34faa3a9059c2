"""The dashboard's pages after a non-editable ``pip install .``, and the base template they share.

``templates/`` and ``static/`` live at the top of the repository; a wheel carries them as data files.
The install test puts the package into a folder with ``pip install --no-deps --target`` (no network:
the build uses this environment's setuptools) and serves pages from there, with the checkout out of
reach, so a template or a script missing from the wheel fails here rather than on a user's machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dashboard.assets import INSTALLED, asset_root
from tests.dashboard.fixtures import DEMO, build_log_root
from tests.helpers import REPO

PAGES = ("index.html", "runs.html", "error.html")

SERVE = """
import json, sys
from pathlib import Path
import dashboard
from dashboard import create_app

client = create_app(sys.argv[1], {"TESTING": True}).test_client()
html = {"Accept": "text/html"}
answers = {url: client.get(url, headers=html) for url in ("/", "/runs", "/no-such-page", "/static/app.js")}
print(json.dumps({
    "package": dashboard.__file__,
    "template_folder": client.application.template_folder,
    "status": {url: r.status_code for url, r in answers.items()},
    "bodies": {url: r.get_data(as_text=True) for url, r in answers.items()},
}))
"""


def copy_source(dest: Path) -> None:
    """What ``pip install .`` builds from, copied, so the build writes nothing into the checkout."""
    for name in ("pyproject.toml", "LICENSE", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("trainer", "dashboard", "templates", "static"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def test_pip_install_target_serves_templates_and_static_files(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    copy_source(source)
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert not (target / "templates").exists()  # data files, not stray top-level folders
    log_root = build_log_root(tmp_path / "logs")
    shutil.rmtree(source)  # nothing may come from the copy the wheel was built from
    env = {k: v for k, v in os.environ.items() if k != "DASHBOARD_TOKEN"}
    env["PYTHONPATH"] = str(target)  # the installed copy, ahead of any editable install of the checkout
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(log_root)],
        cwd=tmp_path,  # not the checkout, whose dashboard/ would otherwise be importable
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    result = json.loads(served.stdout.splitlines()[-1])
    assert Path(result["package"]).resolve().is_relative_to(target.resolve())
    assert Path(result["template_folder"]).resolve() == (target / INSTALLED / "templates").resolve()
    assert result["status"] == {"/": 200, "/runs": 200, "/no-such-page": 404, "/static/app.js": 200}
    assert f'data-run="{DEMO}"' in result["bodies"]["/"]
    assert result["bodies"]["/static/app.js"] == (REPO / "static" / "app.js").read_text()
    for url in ("/", "/runs", "/no-such-page"):  # every page through the shared base template
        assert '<link rel="stylesheet" href="/static/style.css">' in result["bodies"][url]


def test_asset_root_finds_a_prefix_install_above_site_packages(tmp_path):
    """A venv or system install: the package in <prefix>/lib/pythonX.Y/site-packages, data in <prefix>/share."""
    package = tmp_path / "prefix" / "lib" / "python3.11" / "site-packages" / "dashboard"
    package.mkdir(parents=True)
    data = tmp_path / "prefix" / INSTALLED
    shutil.copytree(REPO / "templates", data / "templates")
    shutil.copytree(REPO / "static", data / "static")
    assert asset_root(package) == data


def test_asset_root_prefers_the_checkout():
    assert asset_root() == REPO


def test_pages_extend_one_base_template():
    for page in PAGES:
        source = (REPO / "templates" / page).read_text()
        assert source.startswith('{% extends "base.html" %}'), page
        assert "<head>" not in source and "<!doctype" not in source.lower(), page
