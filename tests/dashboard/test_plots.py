"""Plots: every named PNG renders, the loss plot shows what it promises, and PNGs are cached
until new data arrives."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.dashboard.fixtures import DEMO, NAN_STEP, RESUME_STEP, append, train_record
from trainer import runfolder
from trainer.runfolder.plots import PLOT_NAMES, PlotOptions, figure, write_report
from trainer.runfolder.rundata import RunData
from trainer.runfolder.series import ema, moving_average

PNG = b"\x89PNG\r\n\x1a\n"


def demo_run(log_root: Path, name: str = DEMO) -> RunData:
    run = RunData(name, log_root / name, log_root)
    run.refresh()
    return run


def lines_by_gid(fig, prefix: str):
    return [line for line in fig.axes[0].get_lines() if (line.get_gid() or "").startswith(prefix)]


@pytest.mark.parametrize("name", PLOT_NAMES)
def test_every_plot_is_a_png(client, name: str):
    response = client.get(f"/api/plots/{name}.png")
    assert response.status_code == 200 and response.mimetype == "image/png"
    assert response.data.startswith(PNG) and len(response.data) > 5000
    empty = client.get(f"/api/plots/{name}.png?run=empty")  # no data yet: a placeholder, not an error
    assert empty.status_code == 200 and empty.data.startswith(PNG)


def test_loss_plot_raw_smoothed_evals_and_markers(log_root: Path):
    run = demo_run(log_root)
    fig = figure("loss", run, PlotOptions())
    raw, smoothed = lines_by_gid(fig, "raw:")[0], lines_by_gid(fig, "smoothed:")[0]
    assert raw.get_alpha() < 0.5 and smoothed.get_alpha() is None  # raw faint, smoothed on top
    losses = np.array(run.train.table.columns["loss"])
    assert np.allclose(smoothed.get_ydata(), ema(losses, 0.6), equal_nan=True)
    assert [line.get_xdata()[0] for line in lines_by_gid(fig, "checkpoint")] == [10, 20, 40]
    assert [line.get_xdata()[0] for line in lines_by_gid(fig, "best checkpoint")] == [30]
    assert [line.get_xdata()[0] for line in lines_by_gid(fig, "resume")] == [RESUME_STEP]
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"train loss", "eval loss", "non-finite loss", "checkpoint", "best checkpoint", "resume"} <= set(
        labels
    )
    evals = next(line for line in fig.axes[0].get_lines() if line.get_label() == "eval loss")
    assert list(evals.get_xdata()) == [10, 20, 30, 40]
    nonfinite = next(line for line in fig.axes[0].get_lines() if line.get_label() == "non-finite loss")
    assert list(nonfinite.get_xdata()) == [NAN_STEP]
    assert fig.axes[0].get_yscale() == "linear"


def test_loss_plot_options(log_root: Path):
    run = demo_run(log_root)
    assert figure("loss", run, PlotOptions(log_y=True)).axes[0].get_yscale() == "log"
    off = figure("loss", run, PlotOptions(smoothing="off"))
    assert lines_by_gid(off, "smoothed:") == [] and lines_by_gid(off, "raw:")[0].get_alpha() > 0.5
    moving = lines_by_gid(figure("loss", run, PlotOptions(smoothing="ma", window=5)), "smoothed:")[0]
    assert np.allclose(moving.get_ydata(), moving_average(run.train.table.columns["loss"], 5), equal_nan=True)
    heavy = lines_by_gid(figure("loss", run, PlotOptions(weight=0.95)), "smoothed:")[0]
    assert np.allclose(
        heavy.get_ydata(), ema(np.array(run.train.table.columns["loss"]), 0.95), equal_nan=True
    )
    later = figure("loss", run, PlotOptions(since_step=30))
    assert lines_by_gid(later, "raw:")[0].get_xdata()[0] == 30


def test_two_runs_overlaid(log_root: Path):
    fig = figure("loss", demo_run(log_root), PlotOptions(), compare=demo_run(log_root, "failed"))
    labels = [line.get_gid() for line in lines_by_gid(fig, "smoothed:")]
    assert labels == [f"smoothed:train loss ({DEMO})", "smoothed:train loss (failed)"]


def test_expert_heatmap_is_layer_by_expert(log_root: Path):
    fig = figure("experts", demo_run(log_root), PlotOptions(expert_window="all"))
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (2, 4)
    # Load relative to uniform: (10+50+10)/200 of selections over 4 experts.
    assert image[0, 0] == pytest.approx(70 / 200 * 4)


def test_gpu_plots_have_a_line_per_device(log_root: Path):
    fig = figure("gpu_util", demo_run(log_root), PlotOptions())
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["node1/cpu cpu_pct", "node1/cuda:0 util_pct", "node1/cuda:1 util_pct"]


def test_pngs_are_cached_until_new_data(client, app, log_root: Path):
    cache = app.extensions["dashboard"].plot_cache
    first = client.get("/api/plots/loss.png")
    client.get("/api/plots/gpu_util.png")
    renders = cache.renders
    again = client.get("/api/plots/loss.png")
    assert again.data == first.data and cache.renders == renders
    assert (
        client.get("/api/plots/loss.png", headers={"If-None-Match": first.headers["ETag"]}).status_code == 304
    )
    log = log_root / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    with open(log, "ab") as handle:
        handle.write(b"\n")  # ends the half-written line (it becomes a garbage line)
    append(log, [train_record(41, time.time(), 0.1)])
    fresh = client.get("/api/plots/loss.png", headers={"If-None-Match": first.headers["ETag"]})
    assert fresh.status_code == 200 and fresh.data != first.data and cache.renders == renders + 1
    client.get("/api/plots/gpu_util.png")  # telemetry did not change: still cached
    assert cache.renders == renders + 1


def test_write_report_for_a_finished_run_folder(log_root: Path, tmp_path: Path):
    written = write_report(log_root / DEMO, tmp_path / "report")
    assert sorted(p.name for p in written) == sorted(f"{n}.png" for n in PLOT_NAMES)
    assert all(p.read_bytes().startswith(PNG) for p in written)
