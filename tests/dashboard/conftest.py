"""The dashboard tests' fixtures: a log root of hand-made run folders, and the app and client over it."""

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
