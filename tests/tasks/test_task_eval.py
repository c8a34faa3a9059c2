"""Generation-based evaluation wired into training and the standalone `evaluate` verb."""

from __future__ import annotations

import json
import math
import time

import pytest
import yaml

import trainer.commands.evaluate
from tests.helpers import run_trainer
from trainer import cli, runfolder
from trainer.config import ConfigError, load_config
from trainer.runfolder import iter_records
from trainer.tasks.sql_example import write_example_spider
from trainer.training.task_eval import load_task


def write_sst2(root, rows=12):
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    lines = ["sentence\tlabel"]
    for i in range(rows):
        lines.append(f"{'a fine warm film' if i % 2 else 'a dull cold film'} number {i}\t{i % 2}")
    for split in ("train", "dev"):
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.slow
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
    evals = list(iter_records(run / "logs" / runfolder.EVAL_LOG))
    assert [e["step"] for e in evals] == [2, 4]
    for record in evals:
        assert record["task"] == "sst2" and 0.0 <= record["metrics"]["accuracy"] <= 1.0
        assert record["eval_loss"] > 0 and len(record["samples"]) == 3
    resolved = yaml.safe_load((run / runfolder.CONFIG_YAML).read_text())
    assert resolved["eval"]["metric_for_best"] == "accuracy" and resolved["eval"]["greater_is_better"] is True
    saved = [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == "checkpoint_saved"]
    assert saved[0]["metric"] == "accuracy" and saved[0]["metric_value"] == evals[0]["metrics"]["accuracy"]


@pytest.mark.slow
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


NEVER_ENDS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def test_the_sql_timeout_comes_from_the_config(write_config, tmp_path):
    spider = write_example_spider(tmp_path / "spider")
    config = write_config({"eval": {"task": "spider", "task_data_dir": str(spider), "sql_timeout_s": 0.2}})
    task, examples = load_task(load_config(config))
    assert task.timeout_s == 0.2
    start = time.monotonic()
    result = task.score([" " + NEVER_ENDS], examples[:1])
    assert result["timeouts"] == 1 and time.monotonic() - start < 3  # not the default 5 s
    assert load_task(load_config(config, ["eval.sql_timeout_s=1.5"]))[0].timeout_s == 1.5
    assert load_config(write_config()).eval.sql_timeout_s == 5.0


@pytest.mark.parametrize("bad", ["0", "-1", ".nan", ".inf"])
def test_the_sql_timeout_must_be_a_positive_number_of_seconds(write_config, bad):
    with pytest.raises(ConfigError, match=r"eval.sql_timeout_s: expected (> 0|a finite number|a number)"):
        load_config(write_config(), [f"eval.sql_timeout_s={bad}"])


def test_evaluate_verb_passes_the_sql_timeout_and_writes_nan_as_null(write_config, tmp_path, monkeypatch):
    config = write_config()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    seen = {}

    def fake_evaluate(cfg, checkpoint, with_loss=True):
        seen["timeout"] = cfg.eval.sql_timeout_s
        return {"checkpoint": str(checkpoint), "eval_loss": math.nan, "metrics": {"pearson": None}}

    monkeypatch.setattr(trainer.commands.evaluate, "evaluate_checkpoint", fake_evaluate)
    argv = ["evaluate", "--checkpoint", str(checkpoint), "--config", str(config), "--sql-timeout-s", "0.25"]
    assert cli.main(argv) == 0
    assert seen["timeout"] == 0.25

    def refuse(constant):
        raise AssertionError(f"bare {constant} in JSON")

    written = json.loads((checkpoint / "eval_results.json").read_text(), parse_constant=refuse)
    assert written["eval_loss"] is None and written["nonfinite"] == ["eval_loss"]


def test_answer_room_warns_when_max_new_tokens_cannot_hold_a_label_word(write_config, tmp_path, capsys):
    """The peft bench evaluated sst2 with max_new_tokens 3 on a 1024-token vocabulary, where ' positive' is 6
    tokens: every answer was unparsed and accuracy read 0.000 for every method. The kit now says so."""
    from transformers import AutoTokenizer

    from tests.helpers import REPO
    from trainer.tasks.glue import GlueTask
    from trainer.training.task_eval import answer_room, evaluate_generation

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "configs" / "tiny-mamba2"))
    task = GlueTask("sst2", write_sst2(tmp_path / "glue"))
    assert len(tokenizer(" positive", add_special_tokens=False)["input_ids"]) == 6
    problem = answer_room(task, tokenizer, 3)
    assert "eval.max_new_tokens=3 cannot hold the sst2 answer 'positive' (6 tokens" in problem
    assert "at least 7" in problem
    assert answer_room(task, tokenizer, 7) is None
    assert answer_room(GlueTask("stsb"), tokenizer, 1) is None  # a number: no fixed word to hold

    class OneProcess:  # no model needed: the warning comes before generation, once per task
        num_processes, process_index, is_main_process, distributed_type = 1, 0, True, "NO"

        @staticmethod
        def unwrap_model(model):
            raise RuntimeError("stop after the check")

    cfg = load_config(write_config({"eval": {"max_new_tokens": 3}}))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="stop after the check"):
            evaluate_generation(None, tokenizer, task, task.load("validation")[:2], cfg, OneProcess())
    assert capsys.readouterr().err.count("WARNING: eval.max_new_tokens=3 cannot hold") == 1
