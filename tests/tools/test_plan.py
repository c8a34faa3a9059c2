"""The batch planner: candidates keep the effective batch, OOM and over-margin shapes are rejected."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.faults import run_with_faults
from trainer.tools.planner import candidate_shapes


def plan_cli(config, *extra, inject=""):
    return run_with_faults(*extra, "--config", str(config), oom=inject)


def test_candidates_keep_the_effective_batch():
    shapes = candidate_shapes(8, [64, 32])
    assert [(c.micro, c.accum, c.max_length) for c in shapes] == [
        (1, 8, 64),
        (2, 4, 64),
        (4, 2, 64),
        (8, 1, 64),
        (1, 8, 32),
        (2, 4, 32),
        (4, 2, 32),
        (8, 1, 32),
    ]
    assert all(c.micro * c.accum == 8 for c in shapes)


@pytest.mark.slow
def test_plan_rejects_oom_picks_fastest_and_writes_config(write_config, tmp_path):
    config = write_config({"training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2}})
    result = plan_cli(
        config, "plan", "--lengths", "64,32", "--plan-steps", "1", inject="plan:8,plan:8,plan:8,plan:8"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "plan.json").read_text())
    statuses = {(c["micro"], c["max_length"]): c["status"] for c in record["candidates"]}
    assert statuses[(8, 64)] == "oom" and statuses[(8, 32)] == "oom"
    fitting = [c for c in record["candidates"] if c["status"] == "ok"]
    assert record["chosen"] == max(fitting, key=lambda c: c["tokens_per_sec"])
    assert not (tmp_path / "run" / "config.yaml").exists()  # a run's own record; the plan writes beside it
    chosen_cfg = yaml.safe_load((tmp_path / "run" / "planned_config.yaml").read_text())
    assert chosen_cfg["training"]["micro_batch_size"] == record["chosen"]["micro"]
    assert (
        chosen_cfg["training"]["micro_batch_size"] * chosen_cfg["training"]["gradient_accumulation_steps"]
        == 8
    )
    assert chosen_cfg["data"]["max_length"] == record["chosen"]["max_length"]
    assert "<- chosen" in result.stdout
    assert (
        f"train with: ./launch_training.sh --config {tmp_path / 'run' / 'planned_config.yaml'}"
        in result.stdout
    )


@pytest.mark.slow
def test_nothing_fits_is_a_clear_failure(write_config, tmp_path):
    config = write_config()
    result = plan_cli(config, "plan", "--plan-steps", "1", "--memory-limit-mb", "1")
    assert result.returncode == 1
    assert "no candidate fits in memory" in result.stderr
    record = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert record["chosen"] is None and {c["status"] for c in record["candidates"]} == {"over_margin"}


@pytest.mark.slow
def test_train_auto_plan_trains_with_the_choice(write_config, tmp_path):
    config = write_config(
        {"training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2}}
    )
    result = plan_cli(config, "train", "--auto-plan", "--plan-steps", "1", inject="plan:4")
    assert result.returncode == 0, result.stderr[-2000:]
    used = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["training"]
    chosen = json.loads((tmp_path / "run" / "plan.json").read_text())["chosen"]
    assert used["micro_batch_size"] == chosen["micro"] != 4
