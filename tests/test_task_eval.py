"""Generation-based evaluation wired into training and the standalone `evaluate` verb."""

from __future__ import annotations

import json

import yaml

from tests.helpers import run_trainer
from trainer import runlog
from trainer.runlog import iter_records
from trainer.tasks.sql_example import write_example_spider


def write_sst2(root, rows=12):
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    lines = ["sentence\tlabel"]
    for i in range(rows):
        lines.append(f"{'a fine warm film' if i % 2 else 'a dull cold film'} number {i}\t{i % 2}")
    for split in ("train", "dev"):
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_training_with_a_task_picks_best_by_its_official_metric(write_config, tmp_path):
    glue = write_sst2(tmp_path / "glue")
    config = write_config(
        {
            "training": {"max_steps": 4, "save_steps": 2},
            "eval": {
                "task": "sst2",
                "task_data_dir": str(glue),
                "interval": 2,
                "max_new_tokens": 3,
                "generation_batch_size": 4,
            },
        }
    )
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    evals = list(iter_records(run / "logs" / runlog.EVAL_LOG))
    assert [e["step"] for e in evals] == [2, 4]
    for record in evals:
        assert record["task"] == "sst2" and 0.0 <= record["metrics"]["accuracy"] <= 1.0
        assert record["eval_loss"] > 0 and len(record["samples"]) == 3
    resolved = yaml.safe_load((run / runlog.CONFIG_YAML).read_text())
    assert resolved["eval"]["metric_for_best"] == "accuracy" and resolved["eval"]["greater_is_better"] is True
    saved = [e for e in iter_records(run / "logs" / runlog.EVENTS_LOG) if e["event"] == "checkpoint_saved"]
    assert saved[0]["metric"] == "accuracy" and saved[0]["metric_value"] == evals[0]["metrics"]["accuracy"]


def test_evaluate_verb_scores_a_checkpoint_on_spider(write_config, tmp_path):
    spider = write_example_spider(tmp_path / "spider")
    config = write_config({"training": {"max_steps": 2, "save_steps": 100}})
    assert run_trainer("train", "--config", str(config)).returncode == 0
    checkpoint = tmp_path / "run" / "final-checkpoint-2"
    result = run_trainer(
        "evaluate",
        "--checkpoint",
        str(checkpoint),
        "--task",
        "spider",
        "--task-data-dir",
        str(spider),
        "--max-examples",
        "4",
        "--set",
        "eval.max_new_tokens=8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout[result.stdout.index("{") :])
    assert printed["step"] == 2 and printed["task"] == "spider" and printed["examples"] == 4
    assert set(printed["metrics"]) >= {"execution_accuracy", "exact_match"}
    assert printed["eval_loss"] > 0
    assert json.loads((checkpoint / "eval_results.json").read_text()) == printed


def test_unknown_task_is_a_config_error(write_config):
    result = run_trainer("train", "--config", str(write_config({"eval": {"task": "sst3"}})))
    assert result.returncode == 2 and "eval.task: expected one of cola, sst2" in result.stderr
