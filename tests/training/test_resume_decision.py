"""Which runs count as finished, and what ``train`` and ``plan`` do with them, without training."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_trainer
from trainer import runfolder
from trainer.cli import EXIT_RUN_EXISTS
from trainer.cli import main as cli
from trainer.training.checkpoint_files import STATE_DIR, finished_run


def fake_checkpoint(run: Path, name: str) -> Path:
    """The files that make a checkpoint folder complete for resume discovery."""
    path = run / name
    (path / STATE_DIR).mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"")
    step = runfolder.checkpoint_step(name)
    (path / runfolder.TRAINER_STATE).write_text(json.dumps({"step": step}))
    return path


def test_finished_means_a_final_checkpoint_is_the_latest_or_run_json_says_so(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, "checkpoint-4")
    assert finished_run(run) is None
    fake_checkpoint(run, "final-checkpoint-8")
    assert (finished_run(run).step, finished_run(run).checkpoint.name) == (8, "final-checkpoint-8")
    fake_checkpoint(run, "checkpoint-10")  # extended past its final checkpoint, not finished again yet
    assert finished_run(run) is None

    other = tmp_path / "other"
    other.mkdir()
    (other / runfolder.RUN_JSON).write_text(json.dumps({"status": "finished", "step": 5}))
    assert (finished_run(other).step, finished_run(other).checkpoint) == (5, None)
    (other / runfolder.RUN_JSON).write_text(json.dumps({"status": "interrupted", "step": 5}))
    assert finished_run(other) is None


def test_plan_refuses_a_folder_with_checkpoints_and_writes_nothing(write_config, tmp_path, capsys):
    config = write_config()
    fake_checkpoint(tmp_path / "run", "checkpoint-4")
    (tmp_path / "run-plan").mkdir()  # taken: the suggestion moves on
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert cli(["plan", "--config", str(config)]) == EXIT_RUN_EXISTS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint-4" in err[0]
    assert f"--set paths.output_dir={tmp_path / 'run-plan-2'}" in err[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_auto_plan_on_a_run_without_a_plan_is_refused(write_config, tmp_path):
    config = write_config()
    fake_checkpoint(tmp_path / "run", "checkpoint-4")
    result = run_trainer("train", "--config", str(config), "--auto-plan")
    assert result.returncode == EXIT_RUN_EXISTS, result.stderr[-2000:]
    assert "drop --auto-plan to resume it" in result.stderr


def test_training_a_finished_run_exits_0_before_loading_anything(write_config, tmp_path):
    config = write_config()
    fake_checkpoint(tmp_path / "run", "final-checkpoint-12")  # empty weights: loading them would fail
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "finished at step 12 (final-checkpoint-12); nothing to do" in result.stdout
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["final-checkpoint-12"]
