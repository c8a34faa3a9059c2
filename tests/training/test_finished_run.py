"""A finished run is never rewritten: ``plan`` refuses its folder, training it again is a no-op,
``--extend`` trains further without touching its final checkpoint (issue 11's sequence)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_trainer
from trainer import runfolder
from trainer.cli import EXIT_BAD_INPUT, EXIT_RUN_EXISTS
from trainer.training.checkpoint_files import finished_run


def snapshot(folder: Path) -> dict[str, str]:
    """Every file's content hash, by relative path: what 'nothing was rewritten' means."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in runfolder.iter_records(run / "logs" / runfolder.EVENTS_LOG) if e.get("event") == kind]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny run trained to its end (2 steps): its config file and run folder."""
    tmp = tmp_path_factory.mktemp("finished")
    from tests.helpers import TINY, deep_merge

    cfg = deep_merge(TINY, {"paths": {"output_dir": str(tmp / "run")}})
    cfg = deep_merge(cfg, {"training": {"max_steps": 2, "save_steps": 100}, "eval": {"max_batches": 1}})
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = run_trainer("train", "--config", str(tmp / "config.yaml"))
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp


def copy_of(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The finished run copied into tmp_path, with a config that points at the copy."""
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run)
    cfg = yaml.safe_load((finished / "config.yaml").read_text())
    cfg["paths"]["output_dir"] = str(run)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config, run


@pytest.mark.slow
def test_plan_then_its_advice_never_rewrites_a_finished_run(finished, tmp_path):
    config, run = copy_of(finished, tmp_path)
    before = snapshot(run)

    refused = run_trainer("plan", "--config", str(config), "--plan-steps", "1")
    assert refused.returncode == EXIT_RUN_EXISTS, refused.stdout[-1000:] + refused.stderr[-1000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "final-checkpoint-2" in lines[0], refused.stderr
    assert snapshot(run) == before  # not even a plan.json beside it

    # The refusal's advice: plan into a new folder; then the plan's advice: train with its config.
    suggested = re.search(r"--set (paths\.output_dir=\S+)", lines[0]).group(1)
    planned = run_trainer("plan", "--config", str(config), "--plan-steps", "1", "--set", suggested)
    assert planned.returncode == 0, planned.stderr[-2000:]
    advice = next(line for line in planned.stdout.splitlines() if line.startswith("train with: "))
    command = shlex.split(advice.removeprefix("train with: "))
    assert command[0] == "./launch_training.sh"
    trained = run_trainer("train", *command[1:])
    assert trained.returncode == 0, trained.stderr[-2000:]

    new_run = Path(suggested.split("=", 1)[1])
    chosen = json.loads((new_run / "plan.json").read_text())["chosen"]
    used = yaml.safe_load((new_run / "config.yaml").read_text())
    assert used["training"]["micro_batch_size"] == chosen["micro"]
    assert (new_run / "final-checkpoint-2").is_dir()
    assert snapshot(run) == before


@pytest.mark.slow
def test_training_a_finished_run_again_is_a_no_op_and_extend_trains_further(finished, tmp_path):
    config, run = copy_of(finished, tmp_path)
    before = snapshot(run)

    again = run_trainer("train", "--config", str(config))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "finished at step 2" in again.stdout and "nothing to do" in again.stdout
    assert "--extend" in again.stdout
    assert snapshot(run) == before
    assert len(events(run, "run_end")) == 1

    # Even with a larger max_steps, only --extend trains further.
    bigger = run_trainer("train", "--config", str(config), "--set", "training.max_steps=3")
    assert bigger.returncode == 0 and "add --extend" in bigger.stdout
    assert snapshot(run) == before

    not_bigger = run_trainer("train", "--config", str(config), "--extend")
    assert not_bigger.returncode == EXIT_BAD_INPUT
    assert "expected training.max_steps above it, got 2" in not_bigger.stderr
    assert snapshot(run) == before

    final = {k: v for k, v in before.items() if k.startswith("final-checkpoint-2/")}
    extended = run_trainer("train", "--config", str(config), "--extend", "--set", "training.max_steps=3")
    assert extended.returncode == 0, extended.stderr[-2000:]
    assert "extending run" in extended.stdout
    after = snapshot(run)
    assert {k: after.get(k) for k in final} == final  # the old final checkpoint, byte for byte
    assert (run / "final-checkpoint-3").is_dir()
    resume = events(run, "resume")
    assert len(resume) == 1 and resume[0]["from_checkpoint"].endswith("final-checkpoint-2")
    info = runfolder.read_run_json(run)
    assert info["status"] == "finished" and info["step"] == 3 and info["resumes"] == 1
    assert finished_run(run).step == 3
