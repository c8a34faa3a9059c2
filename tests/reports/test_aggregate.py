"""aggregate: best evaluation per run by the task's official metric, mean ± std over seeds, on made-up logs.

Every expected number below is worked out by hand from the records written here.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
import yaml

from trainer.cli import main
from trainer.reports.aggregate import aggregate, best_evaluation, derive_experiment, official_metrics


def make_run(
    folder: Path,
    evals: list[dict] | None,
    task: str | None = None,
    seed: int = 42,
    status: str = "finished",
    checkpoints=(),
    raw_lines: list[str] = (),
) -> Path:
    (folder / "logs").mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": status, "run_id": folder.name}))
    config = {
        "training": {"seed": seed},
        "eval": {"task": task},
        "paths": {"train_file": "data/corpus.jsonl"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if evals is not None:
        lines = []
        for record in evals:
            metrics = {k: v for k, v in record.items() if k not in ("step", "eval_loss")}
            line = {"ts": 1.0, "step": record["step"], "eval_loss": record.get("eval_loss", 1.0)}
            if metrics:
                line.update(metrics=metrics, task=task)
            lines.append(json.dumps(line))
        (folder / "logs" / "eval_log.jsonl").write_text("\n".join([*lines, *raw_lines]) + "\n")
    for step in checkpoints:
        (folder / f"checkpoint-{step}").mkdir()
    return folder


@pytest.fixture
def runs(tmp_path) -> Path:
    root = tmp_path / "runs"
    glue = root / "glue"
    # CoLA: best by MCC; accuracy is read at that evaluation, not maximised on its own.
    make_run(glue / "cola-lora-seed1", [
        {"step": 2, "matthews_correlation": 0.20, "accuracy": 0.70},
        {"step": 4, "matthews_correlation": 0.40, "accuracy": 0.65},
        {"step": 6, "matthews_correlation": 0.30, "accuracy": 0.80},
    ], task="cola", seed=1, checkpoints=(4, 6))  # fmt: skip
    make_run(glue / "cola-lora-seed2", [
        {"step": 2, "matthews_correlation": 0.50, "accuracy": 0.75},
        {"step": 4, "matthews_correlation": 0.45, "accuracy": 0.90},
    ], task="cola", seed=2, status="running", raw_lines=["{not json"])  # fmt: skip
    # MRPC after a resume: step 4 was written twice, the replayed (last) record counts.
    make_run(glue / "mrpc-lora-seed1", [
        {"step": 2, "f1": 0.80, "accuracy": 0.70},
        {"step": 4, "f1": 0.90, "accuracy": 0.85},
        {"step": 4, "f1": 0.85, "accuracy": 0.80},
        {"step": 6, "f1": 0.86, "accuracy": 0.81},
    ], task="mrpc", seed=1)  # fmt: skip
    make_run(glue / "stsb-lora-seed1", [
        {"step": 2, "pearson": 0.70, "spearman": 0.75},
        {"step": 4, "pearson": 0.72, "spearman": 0.71},
    ], task="stsb", seed=1)  # fmt: skip
    make_run(glue / "mnli-lora-seed1", [
        {"step": 2, "accuracy": 0.65, "accuracy_matched": 0.60, "accuracy_mismatched": 0.70},
        {"step": 4, "accuracy": 0.65, "accuracy_matched": 0.70, "accuracy_mismatched": 0.60},
    ], task="mnli", seed=1)  # fmt: skip
    make_run(glue / "sst2-lora-seed1", [{"step": 2, "accuracy": 0.9}], task="sst2", seed=1)
    make_run(root / "sql" / "spider-seed3", [
        {"step": 2, "execution_accuracy": 0.30, "exact_match": 0.40},
        {"step": 4, "execution_accuracy": 0.35, "exact_match": 0.20},
    ], task="spider", seed=3)  # fmt: skip
    # No task: eval loss, lower is better; a NaN evaluation (written as null) is skipped.
    make_run(root / "lm" / "base-seed1", [
        {"step": 2, "eval_loss": 3.0}, {"step": 4, "eval_loss": 2.5}, {"step": 6, "eval_loss": 2.7},
    ], seed=1, raw_lines=['{"ts": 1, "step": 8, "eval_loss": null, "nonfinite": ["eval_loss"]}'])  # fmt: skip
    make_run(root / "lm" / "base-seed2", [{"step": 2, "eval_loss": 2.0}], seed=2)
    # Left out, not fatal: no eval log; only garbage; nothing finite.
    make_run(root / "broken" / "no-evals", None)
    make_run(root / "broken" / "garbage", [], raw_lines=["garbage", "[1, 2]"])
    make_run(root / "broken" / "all-nan", [], raw_lines=['{"ts": 1, "step": 2, "eval_loss": null}'])
    # A sweep: identity comes from sweep.json; a job that never got a run folder is listed.
    sweep = root / "sweepA"
    make_run(sweep / "tiny_sst2_r8_seed1", [{"step": 2, "accuracy": 0.80}], task="sst2", seed=1)
    make_run(sweep / "tiny_sst2_r8_seed2", [{"step": 2, "accuracy": 0.70}], task="sst2", seed=2)
    jobs = [
        {"name": f"tiny_sst2_r8_seed{s}", "state": "done", "output_dir": str(sweep / f"tiny_sst2_r8_seed{s}"),
         "experiment": "tiny_r8", "dataset": "sst2", "seed": s}
        for s in (1, 2)
    ] + [{"name": "tiny_sst2_r16_seed1", "state": "failed", "output_dir": str(sweep / "tiny_sst2_r16_seed1"),
          "log": str(sweep / "tiny_sst2_r16_seed1" / "job.log"), "experiment": "tiny_r16", "dataset": "sst2", "seed": 1}]  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps({"sweep": "sweepA", "jobs": jobs}))
    return root


def test_best_evaluation_per_task_and_groups_by_hand(runs):
    result = aggregate(runs)
    by_run = {r["run"]: r for r in result["runs"]}
    cola1 = by_run["glue/cola-lora-seed1"]
    assert (cola1["metric"], cola1["best_step"]) == ("matthews_correlation", 4)
    assert cola1["metrics"] == {"matthews_correlation": 0.40, "accuracy": 0.65}
    assert cola1["checkpoint"] == str(runs / "glue" / "cola-lora-seed1" / "checkpoint-4")
    assert by_run["glue/cola-lora-seed2"]["checkpoint"] is None  # pruned: not on disk
    assert by_run["glue/cola-lora-seed2"]["bad_lines"] == 1
    mrpc = by_run["glue/mrpc-lora-seed1"]
    assert (mrpc["best_step"], mrpc["metrics"]) == (6, {"f1": 0.86, "accuracy": 0.81})
    assert by_run["glue/stsb-lora-seed1"]["metrics"] == {"pearson": 0.72, "spearman": 0.71}
    mnli = by_run["glue/mnli-lora-seed1"]
    assert (mnli["metric"], mnli["best_step"]) == ("accuracy_matched", 4)
    assert mnli["metrics"] == {"accuracy_matched": 0.70, "accuracy_mismatched": 0.60}
    assert by_run["glue/sst2-lora-seed1"]["metrics"] == {"accuracy": 0.9}
    spider = by_run["sql/spider-seed3"]
    assert (spider["metric"], spider["metrics"]) == (
        "execution_accuracy",
        {"execution_accuracy": 0.35, "exact_match": 0.20},
    )
    assert (spider["dataset"], spider["experiment"]) == ("spider", "sql")
    lm = by_run["lm/base-seed1"]
    assert (lm["metric"], lm["best_step"]) == ("eval_loss", 4)
    assert lm["metrics"] == {"eval_loss": 2.5, "perplexity": None}  # no perplexity was logged
    assert lm["dataset"] == "corpus"  # no task: the training file names the dataset

    groups = {(g["dataset"], g["experiment"]): g for g in result["groups"]}
    cola = groups[("cola", "glue/lora")]
    assert cola["n"] == 2 and cola["seeds"] == [1, 2] and cola["unfinished"] == 1
    assert cola["metrics"]["matthews_correlation"]["mean"] == pytest.approx(0.45)
    assert cola["metrics"]["matthews_correlation"]["std"] == pytest.approx(
        math.sqrt(0.005)
    )  # (0.05² * 2) / 1
    assert cola["metrics"]["accuracy"]["mean"] == pytest.approx(0.70)
    loss = groups[("corpus", "lm/base")]
    assert loss["metrics"]["eval_loss"]["mean"] == pytest.approx(2.25)
    assert loss["metrics"]["eval_loss"]["std"] == pytest.approx(math.sqrt(0.125))
    single = groups[("mrpc", "glue/lora")]
    assert single["n"] == 1 and single["metrics"]["f1"]["std"] is None
    swept = groups[("sst2", "tiny_r8")]
    assert swept["seeds"] == [1, 2] and swept["metrics"]["accuracy"]["mean"] == pytest.approx(0.75)
    assert {by_run[r]["sweep"] for r in swept["runs"]} == {"sweepA"}

    problems = {p["run"]: p["problem"] for p in result["problems"]}
    assert problems["broken/no-evals"] == "no logs/eval_log.jsonl"
    assert problems["broken/garbage"] == "eval_log.jsonl has no readable records (2 unreadable lines)"
    assert problems["broken/all-nan"] == "no finite task metric or eval_loss in 1 evaluations"
    assert problems["tiny_sst2_r16_seed1"] == "sweep job without a run folder (state failed); see its job.log"
    assert len(result["problems"]) == 4


def test_only_finished_leaves_running_runs_out(runs):
    result = aggregate(runs, only_finished=True)
    assert "glue/cola-lora-seed2" not in {r["run"] for r in result["runs"]}
    assert {"run": "glue/cola-lora-seed2", "problem": "not finished (--only-finished)"}.items() <= next(
        p for p in result["problems"] if p["run"] == "glue/cola-lora-seed2"
    ).items()


def test_cli_writes_csv_json_markdown_and_plot(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["aggregate", "--root", str(runs), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| glue/lora * | 2 | 0.4500 ± 0.0707 | 0.7000 ± 0.0707 |" in printed
    assert "11 runs in 8 groups, 4 left out" in printed
    groups = list(csv.DictReader(io.StringIO((out / "results.csv").read_text())))
    cola = next(g for g in groups if g["dataset"] == "cola")
    assert (cola["experiment"], cola["n"], cola["seeds"], cola["metric"]) == (
        "glue/lora",
        "2",
        "1 2",
        "matthews_correlation",
    )
    assert float(cola["matthews_correlation_mean"]) == pytest.approx(0.45)
    assert float(cola["matthews_correlation_std"]) == pytest.approx(0.0707107, abs=1e-6)
    assert cola["f1_mean"] == ""  # another dataset's metric
    rows = list(csv.DictReader(io.StringIO((out / "runs.csv").read_text())))
    assert len(rows) == 11 and rows[0]["path"] and "checkpoint" in rows[0]
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 11 and len(data["groups"]) == 8 and data["runs"][0]["path"]
    md = (out / "results.md").read_text()
    assert "## mnli" in md and "| glue/lora | 1 | 0.7000 | 0.6000 |" in md
    assert "## Runs left out" in md and "broken/no-evals" in md and str(runs) in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_small_drops_path_columns(runs, tmp_path):
    out = tmp_path / "small"
    assert main(["aggregate", "--root", str(runs), "--output", str(out), "--small"]) == 0
    header = (out / "runs.csv").read_text().splitlines()[0].split(",")
    assert "path" not in header and "checkpoint" not in header and "experiment" in header
    data = json.loads((out / "results.json").read_text())
    assert all("path" not in r and "checkpoint" not in r for r in data["runs"] + data["problems"])
    assert "root" not in data
    assert str(runs) not in (out / "results.md").read_text()


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["aggregate", "--root", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: --root: folder not found: {tmp_path / 'nope'}\n"
    (tmp_path / "empty").mkdir()
    assert main(["aggregate", "--root", str(tmp_path / "empty"), "--output", str(tmp_path / "o")]) == 2
    assert "no run folders under" in capsys.readouterr().err
    make_run(tmp_path / "r" / "a", [{"step": 1, "eval_loss": 1.0}])
    (tmp_path / "file").write_text("x")
    assert main(["aggregate", "--root", str(tmp_path / "r"), "--output", str(tmp_path / "file")]) == 2
    assert "is a file; expected a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("task", "select", "report"),
    [
        ("cola", "matthews_correlation", ("matthews_correlation", "accuracy")),
        ("mrpc", "f1", ("f1", "accuracy")),
        ("qqp", "f1", ("f1", "accuracy")),
        ("stsb", "pearson", ("pearson", "spearman")),
        ("sts-b", "pearson", ("pearson", "spearman")),
        ("mnli", "accuracy_matched", ("accuracy_matched", "accuracy_mismatched")),
        ("sst2", "accuracy", ("accuracy",)),
        ("qnli", "accuracy", ("accuracy",)),
        ("rte", "accuracy", ("accuracy",)),
        ("wnli", "accuracy", ("accuracy",)),
        ("spider", "execution_accuracy", ("execution_accuracy", "exact_match")),
        ("my-task", "accuracy", ("accuracy",)),
        (None, "eval_loss", ("eval_loss", "perplexity")),
    ],
)
def test_official_metric_table(task, select, report):
    official = official_metrics(task)
    assert official.select[0].name == select and official.report == report
    assert official.select[0].greater_is_better is (select != "eval_loss")


def test_mnli_without_subsets_falls_back_to_accuracy_and_ties_keep_the_first():
    records = [
        {"step": 2, "eval_loss": 1.0, "task": "mnli", "metrics": {"accuracy": 0.6}},
        {"step": 4, "eval_loss": 0.9, "task": "mnli", "metrics": {"accuracy": 0.6}},
    ]
    best = best_evaluation(records)
    assert (best["metric"], best["step"], best["value"]) == ("accuracy", 2, 0.6)


def test_experiment_names_drop_seed_and_dataset():
    assert derive_experiment("glue/cola-lora-seed1", "cola", 1) == "glue/lora"
    assert derive_experiment("lora_r8_seed_12", None, 12) == "lora_r8"
    assert derive_experiment("seed3", None, 3) == "seed3"  # nothing left: keep the name
