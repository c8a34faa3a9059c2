"""Matplotlib (Agg) plots of a run, as PNG bytes: the dashboard serves them, end-of-run reports write them.

Here, beside the run-folder model, so that both import it and neither imports the other
(needs numpy and matplotlib: only code that draws imports this module).

Uses ``matplotlib.figure.Figure`` directly (no pyplot): no global state, safe in server threads.
Every plot is downsampled to what a screen shows (first, last and each bucket's extremes kept);
smoothing runs on the full series first. ``render(name, run, options)`` draws one named plot of a
``RunData``; ``write_report(run_dir, out_dir)`` writes them all for a finished run folder.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from trainer.runfolder.rundata import RunData
from trainer.runfolder.series import DEFAULT_EMA_WEIGHT, DEFAULT_MA_WINDOW, downsample_indices, smooth
from trainer.runfolder.summaries import best_eval, checkpoint_rows, experts

SCREEN_POINTS = 2000
WIDTH, HEIGHT, DPI = 8.0, 3.2, 100
COLORS = ("#1f6feb", "#d9480f", "#2f9e44", "#9c36b5", "#e8590c", "#0c8599", "#c2255c", "#5c940d")

# Which logs each plot draws on: the plot cache and the page reload a plot when these change.
PLOT_SOURCES = {
    "loss": ("train", "eval", "events"),
    "lr": ("train",),
    "throughput": ("train",),
    "grad_norm": ("train",),
    "memory": ("train",),
    "gpu_util": ("gpu",),
    "gpu_memory": ("gpu",),
    "experts": ("experts",),
}
PLOT_NAMES = tuple(PLOT_SOURCES)


@dataclass(frozen=True)
class PlotOptions:
    smoothing: str = "ema"
    weight: float = DEFAULT_EMA_WEIGHT
    window: int = DEFAULT_MA_WINDOW
    log_y: bool = False
    since_step: int = 0
    expert_window: str = "latest"
    from_step: int | None = None
    to_step: int | None = None


# ---------------------------------------------------------------- drawing helpers


def new_axes(title: str, xlabel: str, ylabel: str, width: float = WIDTH, height: float = HEIGHT):
    fig = Figure(figsize=(width, height), dpi=DPI, layout="tight")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.25)
    return fig, ax


def to_png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="#868e96", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def set_log_y(ax, values: np.ndarray, log_y: bool) -> None:
    """Log scale only when asked and when there is something positive to show."""
    if log_y and np.any(np.isfinite(values) & (values > 0)):
        ax.set_yscale("log")


def draw_smoothed(ax, x: np.ndarray, y: np.ndarray, options: PlotOptions, color: str, label: str) -> None:
    """The raw series faint, the smoothed one on top (both downsampled after smoothing).

    Artists carry ``gid`` ``raw:<label>`` and ``smoothed:<label>`` so reports and tests can find them.
    """
    smoothed = smooth(y, options.smoothing, options.weight, options.window)
    keep = downsample_indices(y, SCREEN_POINTS)
    faint = smoothed is not None
    raw_label = None if faint else label
    ax.plot(
        x[keep],
        y[keep],
        color=color,
        alpha=0.25 if faint else 0.9,
        lw=1.0,
        label=raw_label,
        gid=f"raw:{label}",
    )
    if faint:
        ax.plot(x[keep], smoothed[keep], color=color, lw=1.6, label=label, gid=f"smoothed:{label}")


def draw_markers(ax, steps: list[int], color: str, style: str, label: str) -> None:
    """Vertical lines at ``steps`` (one legend entry), each with ``gid`` = ``label``."""
    for i, step in enumerate(steps):
        ax.axvline(step, color=color, ls=style, lw=0.9, alpha=0.7, label=label if i == 0 else None, gid=label)


# ---------------------------------------------------------------- data from a run


def train_column(run: RunData, name: str, since_step: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a training-log field from ``since_step`` on, as copies."""
    with run.lock:
        table = run.train.table
        start = table.index_from(since_step)
        column = table.columns.get(name)
        if column is None:
            return np.empty(0), np.empty(0)
        steps = np.frombuffer(table.steps[start:], dtype=np.int64)
        return steps, np.frombuffer(column[start:], dtype=float)


def loss_markers(run: RunData) -> dict:
    """Steps of checkpoints, resumes and non-finite losses, and the eval points, for the loss plot."""
    with run.lock:
        rows = checkpoint_rows(run)
        resumes = [
            e["step"] for e in run.events.items if e["event"] == "resume" and isinstance(e.get("step"), int)
        ]
        evals = [
            (r["step"], float(r["eval_loss"]))
            for r in run.evals.records()
            if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])
        ]
        best = best_eval(run)
    return {
        "checkpoints": [r["step"] for r in rows if r["step"] is not None and not r["best"]],
        "best": [r["step"] for r in rows if r["step"] is not None and r["best"]],
        "resumes": resumes,
        "evals": evals,
        "best_eval": best,
    }


# ---------------------------------------------------------------- the plots


def plot_loss(run: RunData, options: PlotOptions, compare: RunData | None = None) -> Figure:
    """Training loss: raw faint, smoothed on top, eval points, checkpoint and resume markers."""
    fig, ax = new_axes(f"loss - {run.name}", "step", "loss")
    steps, loss = train_column(run, "loss", options.since_step)
    if not len(steps):
        no_data(ax, "no training records yet")
        return fig
    draw_smoothed(
        ax, steps, loss, options, COLORS[0], f"train loss ({run.name})" if compare else "train loss"
    )
    bad = steps[~np.isfinite(loss)]
    if len(bad):
        ax.plot(
            bad,
            np.zeros(len(bad)),
            "x",
            color="#e03131",
            transform=ax.get_xaxis_transform(),
            label="non-finite loss",
        )
    marks = loss_markers(run)
    evals = [(s, v) for s, v in marks["evals"] if s >= options.since_step]
    if evals:
        ax.plot(*zip(*evals), "o", color=COLORS[1], markersize=4, label="eval loss")
    draw_markers(
        ax, [s for s in marks["checkpoints"] if s >= options.since_step], "#868e96", ":", "checkpoint"
    )
    draw_markers(ax, [s for s in marks["best"] if s >= options.since_step], "#f08c00", "-", "best checkpoint")
    draw_markers(ax, [s for s in marks["resumes"] if s >= options.since_step], "#e03131", "--", "resume")
    values = loss
    if compare is not None:
        other_steps, other_loss = train_column(compare, "loss", options.since_step)
        if len(other_steps):
            draw_smoothed(ax, other_steps, other_loss, options, COLORS[2], f"train loss ({compare.name})")
            values = np.concatenate((loss, other_loss))
    set_log_y(ax, values, options.log_y)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def plot_train_field(
    run: RunData, options: PlotOptions, name: str, title: str, ylabel: str, smoothed: bool
) -> Figure:
    fig, ax = new_axes(f"{title} - {run.name}", "step", ylabel)
    steps, values = train_column(run, name, options.since_step)
    if not len(steps) or not np.any(np.isfinite(values)):
        no_data(ax, f"no {name} logged yet")
        return fig
    plain = options if smoothed else PlotOptions(smoothing="off")
    draw_smoothed(ax, steps, values, plain, COLORS[0], name)
    set_log_y(ax, values, options.log_y)
    return fig


def plot_gpu(run: RunData, options: PlotOptions, fields: tuple[str, ...], title: str, ylabel: str) -> Figure:
    """One line per device (and field): time on x in minutes since the first sample."""
    fig, ax = new_axes(f"{title} - {run.name}", "minutes", ylabel)
    with run.lock:
        series = {
            key: {n: np.frombuffer(c.columns[n][:], dtype=float) for n in ("ts", *fields) if n in c.columns}
            for key, c in sorted(run.gpu.series.items())
        }
    lines = [
        (key, f, cols["ts"], cols[f])
        for key, cols in series.items()
        if "ts" in cols
        for f in fields
        if f in cols
    ]
    lines = [(key, f, t, v) for key, f, t, v in lines if np.any(np.isfinite(v))]
    if not lines:
        no_data(ax, "no telemetry logged yet")
        return fig
    start = min(float(np.nanmin(t)) for _, _, t, _ in lines)
    for i, (key, name, ts, values) in enumerate(lines):
        keep = downsample_indices(values, SCREEN_POINTS)
        label = key if len(fields) == 1 else f"{key} {name}"
        ax.plot(
            (ts[keep] - start) / 60.0, values[keep], color=COLORS[i % len(COLORS)], linewidth=1.2, label=label
        )
    set_log_y(ax, np.concatenate([v for *_, v in lines]), options.log_y)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def plot_experts(run: RunData, options: PlotOptions) -> Figure:
    """Heatmap of layer x expert load relative to uniform (1.0 = its fair share)."""
    usage = experts(run, options.expert_window, options.from_step, options.to_step)
    layers = usage["layers"]
    height = max(HEIGHT, min(12.0, 1.2 + 0.22 * len(layers)))
    fig, ax = new_axes(f"expert usage - {run.name}", "expert", "layer", height=height)
    if not layers:
        no_data(ax, "no expert usage logged (dense model, or before the first window)")
        return fig
    width = max(len(layer["fractions"]) for layer in layers)
    matrix = np.full((len(layers), width), np.nan)
    for row, layer in enumerate(layers):
        matrix[row, : len(layer["fractions"])] = np.asarray(layer["fractions"]) * len(layer["fractions"])
    ax.grid(False)
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0)
    ax.set_yticks(range(len(layers)), [str(layer["layer"]) for layer in layers], fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    bar = fig.colorbar(image, ax=ax)
    bar.set_label("load / uniform share", fontsize=8)
    bar.ax.tick_params(labelsize=8)
    ax.set_title(
        f"expert usage - {run.name}, steps {usage['from_step']}-{usage['to_step']}", fontsize=10, loc="left"
    )
    return fig


def render(name: str, run: RunData, options: PlotOptions, compare: RunData | None = None) -> bytes:
    """One named plot (see ``PLOT_NAMES``) of a refreshed run as PNG bytes."""
    return to_png(figure(name, run, options, compare))


def figure(name: str, run: RunData, options: PlotOptions, compare: RunData | None = None) -> Figure:
    """One named plot of a refreshed run as a matplotlib Figure (to inspect, restyle or save)."""
    if name == "loss":
        return plot_loss(run, options, compare)
    if name == "lr":
        return plot_train_field(run, options, "lr", "learning rate", "lr", smoothed=False)
    if name == "throughput":
        return plot_train_field(run, options, "tokens_per_sec", "throughput", "tokens / s", smoothed=True)
    if name == "grad_norm":
        return plot_train_field(
            run, options, "grad_norm", "gradient norm (before clipping)", "norm", smoothed=True
        )
    if name == "memory":
        return plot_train_field(run, options, "peak_mem_mb", "peak memory (rank 0)", "MiB", smoothed=False)
    if name == "gpu_util":
        return plot_gpu(run, options, ("util_pct", "cpu_pct"), "utilisation", "%")
    if name == "gpu_memory":
        return plot_gpu(
            run, options, ("mem_used_mb", "proc_rss_mb", "ram_used_mb"), "device memory used", "MiB"
        )
    if name == "experts":
        return plot_experts(run, options)
    raise KeyError(name)


def write_report(run_dir: str | Path, out_dir: str | Path, options: PlotOptions | None = None) -> list[Path]:
    """Write every plot of a run folder as ``<out_dir>/<name>.png`` (for end-of-run reports)."""
    run_dir = Path(run_dir).resolve()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = RunData(run_dir.name, run_dir, run_dir)
    run.refresh()
    written = []
    for name in PLOT_NAMES:
        path = out / f"{name}.png"
        path.write_bytes(render(name, run, options or PlotOptions()))
        written.append(path)
    return written
