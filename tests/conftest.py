"""Shared fixtures: tiny configs written to tmp folders, and one real default run per test session.

Fixtures that only one area uses live in that area's conftest.py (tests/dashboard/conftest.py, ...)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import TINY, deep_merge, run_trainer

# The data cache of every test (and every trainer the tests start) lives in one temporary folder, never in
# the user's ~/.cache; tests that check building versus reusing set data.cache_dir of their own.
os.environ.setdefault("FINETUNE_KIT_DATA_CACHE", tempfile.mkdtemp(prefix="kit-data-cache-"))


@pytest.fixture
def write_config(tmp_path):
    """Write a tiny config (plus overrides) into tmp_path and return its path."""

    def _write(extra: dict | None = None, name: str = "config.yaml", output: str = "run") -> Path:
        cfg = deep_merge(TINY, {"paths": {"output_dir": str(tmp_path / output)}})
        cfg = deep_merge(cfg, extra or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return path

    return _write


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The shipped training_config.yaml, run once, unchanged but for the output folder."""
    out = tmp_path_factory.mktemp("default") / "runs" / "default"
    started = time.time()
    result = run_trainer(
        "train", "--config", "training_config.yaml", "--set", f"paths.output_dir={out}", timeout=2400
    )
    wall = time.time() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"path": out, "stdout": result.stdout, "stderr": result.stderr, "wall": wall}
