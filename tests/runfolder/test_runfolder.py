"""The run-folder library on its own: record builders, the one reader's one-shot reads, discovery,
the best rule's pieces, and that it imports nothing but the standard library."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO
from trainer import runfolder
from trainer.runfolder import EvalRecord, MetricForBest, RunLog, TrainRecord
from trainer.runfolder.best import GLUE_METRICS


def test_required_fields_come_from_the_record_builders():
    assert runfolder.REQUIRED_FIELDS[runfolder.TRAINING_LOG] == (
        "ts", "step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec",
        "steps_per_sec", "eta_seconds", "elapsed", "peak_mem_mb",
    )  # fmt: skip
    assert runfolder.REQUIRED_FIELDS[runfolder.EVAL_LOG] == (
        "ts",
        "step",
        "eval_loss",
        "perplexity",
        "eval_tokens",
    )
    assert TrainRecord.optional() == ("aux_loss", "skipped")


def test_eval_record_carries_the_metric_it_was_ranked_by(tmp_path):
    result = {"task": "sst2", "metrics": {"accuracy": 0.5}, "samples": [], "eval_seconds": 3.0}
    record = EvalRecord.from_result(7, result, MetricForBest("accuracy"), is_best=True)
    log = RunLog(tmp_path)
    log.append(record)
    log.close()
    (written,) = runfolder.iter_records(tmp_path / "logs" / runfolder.EVAL_LOG)
    assert written["step"] == 7 and written["is_best"] is True
    assert (written["metric_for_best"], written["greater_is_better"]) == ("accuracy", True)
    assert written["eval_loss"] is None  # a task-only evaluation: the loss fields are there, null
    assert written["eval_seconds"] == 3.0  # a field the builder does not declare yet is still written


def test_read_log_counts_garbage_but_not_a_half_written_last_line(tmp_path):
    path = tmp_path / "eval_log.jsonl"
    path.write_bytes(b'{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2, "new_field": "x"}\n{"step": 3, "eval')
    records, bad = runfolder.read_log(path)
    assert [r["step"] for r in records] == [1, 2] and bad == 2
    assert list(runfolder.iter_records(tmp_path / "missing.jsonl")) == []


def test_sweeps_are_found_once_and_name_their_jobs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / runfolder.SWEEP_JSON).write_text(
        json.dumps({"jobs": [{"output_dir": str(tmp_path / "a/j1")}]})
    )
    (tmp_path / runfolder.SWEEP_JSON).write_text("{broken")
    sweeps = runfolder.find_sweeps(tmp_path)
    assert [p.parent.name for p, _ in sweeps] == ["a"]
    jobs = runfolder.sweep_jobs(sweeps)
    assert jobs[os.path.realpath(tmp_path / "a/j1")]["sweep"] == "a"  # no name in sweep.json: its folder's


def test_folder_size_counts_files_not_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "f")
    assert runfolder.folder_size(tmp_path) == 10


def test_official_metrics_match_the_tasks_and_tasks_use_the_library_rule():
    from trainer.tasks import GLUE_TASKS
    from trainer.tasks import MetricForBest as TaskMetric
    from trainer.tasks.glue import SPECS

    assert TaskMetric is MetricForBest
    for name in GLUE_TASKS:
        if name != "mnli":
            assert runfolder.official_metrics(name).report == SPECS[name].metric_names
    assert set(GLUE_METRICS) == {n for n in GLUE_TASKS if SPECS[n].metric_names != ("accuracy",)}


def test_metric_for_best_never_picks_none_or_nan():
    lower = MetricForBest("eval_loss", greater_is_better=False)
    assert not lower.is_better(None, 1.0) and not lower.is_better(float("nan"), None)
    assert lower.is_better(0.5, None) and lower.is_better(0.5, 1.0) and not lower.is_better(1.0, 1.0)
    assert runfolder.guess_greater_is_better("accuracy") and not runfolder.guess_greater_is_better("val_loss")


def test_the_library_imports_only_the_standard_library():
    script = (
        "import sys; import trainer.runfolder, trainer.runfolder.summaries; "
        "print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'torch', 'yaml', 'matplotlib', 'flask', 'dashboard')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
