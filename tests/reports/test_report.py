"""End-of-run report: a static page with local PNGs from a run folder alone, and the ASCII loss curve."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import REPO, run_trainer
from trainer import runfolder
from trainer.cli import main
from trainer.reports.report import (
    INDEX,
    LENGTHS_PNG,
    REPORT_DIR,
    ReportError,
    ascii_loss_curve,
    length_figure,
    summarize,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 100


def loss_at(step: int) -> float:
    return 10.0 - 9.0 * (step - 1) / (STEPS - 1)  # 10 at step 1, 1 at step 100


@pytest.fixture
def hand_run(tmp_path) -> Path:
    """A minimal run folder written with the trainer's own run-folder library: a resume, a NaN, a failure."""
    run = tmp_path / "hand"
    log = runfolder.RunLog(run)
    log.update_run(
        run_id="hand-1",
        status="failed",
        model="configs/tiny-llama",
        family="causal",
        method="lora",
        world_size=1,
        hosts=["node7"],
        total_steps=STEPS,
        started_at=1000.0,
        ended_at=1600.0,
        versions={"torch": "2.13.0"},
    )
    for step in range(1, STEPS + 1):
        loss = float("nan") if step == 50 else loss_at(step)
        log.write(
            runfolder.TRAINING_LOG,
            {
                "step": step,
                "total_steps": STEPS,
                "loss": loss,
                "tokens_per_sec": 1000.0 + step,
                "peak_mem_mb": 500.0,
            },
        )
    log.write(
        runfolder.TRAINING_LOG, {"step": 60, "total_steps": STEPS, "loss": loss_at(60)}
    )  # replayed after resume
    for step, value in ((20, 6.0), (40, 4.5), (60, 3.9)):
        log.write(
            runfolder.EVAL_LOG,
            {"step": step, "eval_loss": value, "perplexity": math.exp(value), "eval_tokens": 9},
        )
    log.event("checkpoint_saved", step=20, path=str(run / "checkpoint-20"), kind="periodic", metric_value=6.0)
    log.event("checkpoint_saved", step=40, path=str(run / "checkpoint-40"), kind="periodic", metric_value=4.5)
    log.event("checkpoint_pruned", step=20, path=str(run / "checkpoint-20"))
    log.event("best_updated", step=40, metric="eval_loss", metric_value=4.5, path=str(run / "best-adapter"))
    log.write(
        runfolder.ERROR_LOG,
        {"step": 100, "type": "RuntimeError", "message": "disk <full>", "traceback": "Trace"},
    )
    log.close()
    runfolder.write_json_atomic(
        run / "data_report.json",
        {
            "train_file": "data/x.jsonl",
            "max_length": 64,
            "records_analyzed": 6,
            "sampled": False,
            "lengths": {"count": 6, "min": 3, "median": 20, "p90": 70, "p95": 70, "p99": 70, "max": 70},
            "histogram": {"edges": [0, 25, 50, 75], "counts": [3, 2, 1]},
            "strategies": {"truncate": {"chunks": 6, "lost_tokens": 6, "unsplittable_segments": 0}},
        },
    )
    return run


def image_sources(page: str) -> list[str]:
    return re.findall(r"<img src='([^']+)'", page)


def test_page_and_pngs_from_a_hand_made_run(hand_run):
    index = write_report(hand_run)
    assert index == hand_run / REPORT_DIR / INDEX
    page = index.read_text()
    sources = image_sources(page)
    assert {"loss.png", "throughput.png", "memory.png", LENGTHS_PNG} <= set(sources)
    assert "experts.png" not in sources  # no expert log: not a MoE run
    for name in sources:
        assert (index.parent / name).read_bytes().startswith(PNG_MAGIC), name
    # Everything local: no scripts, no remote URLs anywhere.
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "<span class='status failed'>failed</span>" in page
    assert "disk &lt;full&gt;" in page and "<full>" not in page  # escaped
    assert "1 at step 100" in page  # final loss 1.0 (step 100), lowest too
    assert "3.9 at step 60" in page  # best eval
    assert "1 / 0" in page  # one non-finite step, none skipped
    assert "pruned" in page and "checkpoint-40" in page
    assert "600 s" in page and "node7" in page


def test_summary_numbers(hand_run):
    s = summarize(hand_run)
    assert s["train_records"] == STEPS and s["nonfinite_steps"] == [50]
    assert s["first_loss"] == 10.0 and s["final_loss"] == pytest.approx(1.0)
    assert s["min_loss"] == (100, pytest.approx(1.0))
    assert s["best_eval"] == (60, 3.9) and s["final_eval_loss"] == 3.9
    assert s["median_tokens_per_sec"] == pytest.approx(1050.5, abs=1.0)
    assert [c["kept"] for c in s["checkpoints"]] == [False, True]
    assert s["duration_seconds"] == 600.0


def test_length_histogram_draws_the_data_report(hand_run):
    import json

    report = json.loads((hand_run / "data_report.json").read_text())
    fig = length_figure(report)
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_gid() == "lengths"]
    assert [b.get_height() for b in bars] == [3, 2, 1]
    assert [b.get_x() for b in bars] == [0, 25, 50] and [b.get_width() for b in bars] == [25, 25, 25]
    (limit,) = [line for line in ax.lines if line.get_gid() == "max_length"]
    assert list(limit.get_xdata()) == [64, 64]
    empty = length_figure(None)
    assert not [p for p in empty.axes[0].patches if p.get_gid() == "lengths"]
    assert "preprocess --analyze-only" in empty.axes[0].texts[0].get_text()


def test_ascii_curve_shape(hand_run):
    text = ascii_loss_curve(hand_run, width=50, height=10)
    lines = text.splitlines()
    assert lines[0] == "loss, steps 1-100 (99 records, ~1.98 steps per column, 1 non-finite skipped)"
    plot = lines[1:11]
    assert len(plot) == 10 and all(len(row.split("|", 1)[1]) == 50 for row in plot)
    # Top: the first column is step 1 alone (10); bottom: steps 99-100, mean 1.045.
    assert plot[0].split("|")[0].strip() == "10" and plot[-1].split("|")[0].strip() == "1.045"
    cells = [row.split("|", 1)[1] for row in plot]
    assert cells[0][0] == "*" and cells[-1][-1] == "*"  # falls from top left to bottom right
    assert all("".join(row[c] for row in cells).count("*") == 1 for c in range(50))  # one mark per column
    heights = [next(r for r, row in enumerate(cells) if row[c] == "*") for c in range(50)]
    assert heights == sorted(heights)  # a falling loss never goes up
    assert lines[11].endswith("+" + "-" * 50) and lines[12].split() == ["1", "100"]


def test_ascii_curve_with_few_points_and_none(tmp_path, hand_run):
    few = tmp_path / "few"
    log = runfolder.RunLog(few)
    for step, loss in ((1, 3.0), (2, 2.0), (3, 2.0)):
        log.write(runfolder.TRAINING_LOG, {"step": step, "loss": loss})
    log.close()
    cells = [row.split("|", 1)[1] for row in ascii_loss_curve(few, width=60, height=4).splitlines()[1:5]]
    assert cells == ["*  ", "   ", "   ", " **"]
    empty = tmp_path / "empty"
    runfolder.RunLog(empty).update_run(status="running")
    assert ascii_loss_curve(empty) == "loss: no finite training records yet"
    assert write_report(empty).is_file()  # plots say "no data" rather than failing


def test_not_a_run_folder(tmp_path, capsys):
    with pytest.raises(ReportError, match="not a run folder"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err


def copy_run(src: Path, dst: Path) -> Path:
    """The run's logs and records, without checkpoint weights (the report reads none)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "training_state", REPORT_DIR))
    return dst


@pytest.mark.slow
def test_report_of_a_real_run(default_run, tmp_path):
    run = copy_run(default_run["path"], tmp_path / "default")
    result = run_trainer("report", str(run), cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    index = run / REPORT_DIR / INDEX
    assert f"report: {index}" in result.stdout
    train = runfolder.last_per_step(
        list(runfolder.iter_records(run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG))
    )
    assert result.stdout.startswith(f"loss, steps 1-{train[-1]['step']} ")
    page = index.read_text()
    assert "<span class='status finished'>finished</span>" in page
    assert f"<td>{train[-1]['loss']:.4g}</td>" in page
    sources = image_sources(page)
    assert "experts.png" in sources  # the default model is a MoE
    for name in sources:
        png = (index.parent / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name
    cells = [row.split("|", 1)[1] for row in ascii_loss_curve(run).splitlines()[1:13]]
    assert cells[0].index("*") < 5 and cells[-1].rstrip().endswith("*")  # the loss fell
