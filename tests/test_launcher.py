"""launch_training.sh: passes arguments through, validates first (exit 2), resumes by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, trainer_env


def launch(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # Reuse the virtual environment the tests run in (the script installs into it only what is missing).
    env = dict(trainer_env(), VENV_DIR=str(Path(sys.prefix)), NUM_PROCESSES="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(REPO / "launch_training.sh"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_bad_config_exits_2_before_training(write_config):
    result = launch("--config", str(write_config()), "--set", "eval.interval=0")
    assert result.returncode == 2
    assert "config error: --set eval.interval=0: eval.interval: expected > 0, got 0" in result.stderr


def test_unknown_argument_exits_2():
    result = launch("--sett", "x")
    assert result.returncode == 2 and "unknown argument '--sett'" in result.stderr


def test_runs_then_resumes_by_itself(write_config, tmp_path):
    config = write_config({"training": {"max_steps": 2, "save_steps": 100}})
    first = launch("--config", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"run folder: {tmp_path / 'run'}" in first.stdout
    second = launch("--config", str(config), "--set", "training.max_steps=4", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming from {tmp_path / 'run' / 'final-checkpoint-2'}" in second.stdout
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == 4 and info["resumes"] == 1


def test_resume_from_a_wrong_path_is_exit_2(write_config, tmp_path):
    result = launch("--config", str(write_config()), "--resume_from", str(tmp_path / "missing"))
    assert result.returncode == 2 and "--resume_from: path not found" in result.stderr
    assert os.access(REPO / "launch_training.sh", os.X_OK)
