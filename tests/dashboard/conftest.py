"""The dashboard tests' fixtures: a log root of hand-made run folders, the app and client over it, and
the run folder of the session's real default run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard import create_app
from tests.dashboard.fixtures import build_log_root


@pytest.fixture
def log_root(tmp_path: Path) -> Path:
    return build_log_root(tmp_path)


@pytest.fixture
def app(log_root: Path):
    return create_app(log_root, {"TESTING": True})


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="session")
def trained_run(default_run) -> Path:
    """A run folder produced by the real trainer (``default_run``, from tests/conftest.py)."""
    return default_run["path"]
