"""launch_training.sh under a scheduler's SIGTERM (sent to every process, as scancel, preemption and
`scontrol requeue` do): the launcher outlives its trainer, so a job step that waits for the launcher
never ends while the checkpoint is being written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, trainer_env, wait_for
from trainer import runfolder
from trainer.runfolder import iter_records


@pytest.mark.slow
def test_launcher_waits_for_the_trainer_to_save_on_sigterm(write_config, tmp_path):
    config = write_config({"training": {"max_steps": 400, "save_steps": 1000}})
    run = tmp_path / "run"
    env = dict(trainer_env(), VENV_DIR=str(Path(sys.prefix)), NUM_PROCESSES="1")
    env.pop("PYTHONPATH", None)
    launcher = subprocess.Popen(
        ["bash", str(REPO / "launch_training.sh"), "--config", str(config)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    log = run / "logs" / runfolder.TRAINING_LOG
    assert wait_for(lambda: log.exists() and len(list(iter_records(log))) >= 2 or launcher.poll() is not None)
    os.killpg(launcher.pid, signal.SIGTERM)  # the launcher, its subshell and the trainer, all at once
    output, _ = launcher.communicate(timeout=120)
    # Without the traps bash dies at once (-15) and the trainer is still saving when it is gone.
    assert launcher.returncode == 143, output[-3000:]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted"
    saved = [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == "checkpoint_saved"]
    assert saved[-1]["kind"] == "signal" and (run / f"checkpoint-{info['step']}").is_dir()
