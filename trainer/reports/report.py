"""End-of-run report from a run folder alone: ``<run>/report/index.html`` with PNG plots, and an ASCII
loss curve for the terminal.

The plots are the run-folder library's (``trainer.runfolder.plots``, the ones the dashboard serves:
loss, lr, throughput, grad norm, memory, telemetry, experts) plus a token-length histogram from
``data_report.json`` drawn with the same figure helpers; the best evaluation is the library's one rule. Everything is local: one HTML file with inline CSS and relative image
paths, no script, no CDN. No torch here: reports run anywhere matplotlib does.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import time
from pathlib import Path

from trainer import runfolder
from trainer.runfolder import DATA_REPORT_JSON, REPORT_DIR

INDEX = "index.html"
LENGTHS_PNG = "lengths.png"
# Plot files in page order; plots.write_report writes all of PLOT_NAMES, the page shows these.
PAGE_PLOTS = (
    "loss",
    "throughput",
    "memory",
    "lengths",
    "lr",
    "grad_norm",
    "gpu_util",
    "gpu_memory",
    "experts",
)


class ReportError(ValueError):
    """The folder is not a run folder, or the plotting libraries are missing."""


def _records(run_dir: Path, name: str) -> list[dict]:
    return list(runfolder.iter_records(runfolder.log_path(run_dir, name)))


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def check_run_folder(run_dir: str | os.PathLike) -> Path:
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such folder (expected a run folder, the training output_dir)")
    if not (path / runfolder.RUN_JSON).is_file() and not (path / runfolder.LOGS_DIR).is_dir():
        raise ReportError(f"{path}: not a run folder (no {runfolder.RUN_JSON} and no {runfolder.LOGS_DIR}/)")
    return path


# ---------------------------------------------------------------- ASCII


def ascii_loss_curve(run_dir: str | os.PathLike, width: int = 60, height: int = 12) -> str:
    """The training loss as ``*`` marks on a ``height`` x ``width`` grid (a column = mean of its steps)."""
    train = runfolder.last_per_step(_records(Path(run_dir), runfolder.TRAINING_LOG))
    points = [(r["step"], float(r["loss"])) for r in train if _finite(r.get("loss")) is not None]
    skipped = len(train) - len(points)
    if not points:
        return "loss: no finite training records yet"
    width, height = max(2, width), max(2, height)
    columns = min(width, len(points))
    values = []
    for c in range(columns):
        bucket = points[c * len(points) // columns : (c + 1) * len(points) // columns]
        values.append(sum(v for _, v in bucket) / len(bucket))
    lo, hi = min(values), max(values)
    rows = [[" "] * columns for _ in range(height)]
    for c, value in enumerate(values):
        level = round((value - lo) / (hi - lo) * (height - 1)) if hi > lo else 0
        rows[height - 1 - level][c] = "*"
    top, bottom = f"{hi:.4g}", f"{lo:.4g}"
    pad = max(len(top), len(bottom))
    first, last = str(points[0][0]), str(points[-1][0])
    per_column = f", ~{len(points) / columns:.3g} steps per column" if columns < len(points) else ""
    note = f", {skipped} non-finite skipped" if skipped else ""
    lines = [f"loss, steps {first}-{last} ({len(points)} records{per_column}{note})"]
    for i, row in enumerate(rows):
        label = top if i == 0 else bottom if i == height - 1 else ""
        lines.append(f"{label:>{pad}} |{''.join(row)}")
    lines.append(f"{'':>{pad}} +{'-' * columns}")
    lines.append(f"{'':>{pad}}  {first}{last:>{max(1, columns - len(first))}}")
    return "\n".join(lines)


# ---------------------------------------------------------------- numbers


def summarize(run_dir: str | os.PathLike) -> dict:
    """What the page states in words and tables, from run.json and the logs."""
    run_dir = Path(run_dir)
    info = runfolder.read_run_json(run_dir)
    train = runfolder.last_per_step(_records(run_dir, runfolder.TRAINING_LOG))
    evals = runfolder.last_per_step(_records(run_dir, runfolder.EVAL_LOG))
    events = _records(run_dir, runfolder.EVENTS_LOG)
    errors = _records(run_dir, runfolder.ERROR_LOG)
    finite_loss = [(r["step"], float(r["loss"])) for r in train if _finite(r.get("loss")) is not None]
    throughput = [float(r["tokens_per_sec"]) for r in train if _finite(r.get("tokens_per_sec"))]
    memory = [float(r["peak_mem_mb"]) for r in train if _finite(r.get("peak_mem_mb"))]
    eval_points = [
        (r["step"], float(r["eval_loss"])) for r in evals if _finite(r.get("eval_loss")) is not None
    ]
    pruned = {e.get("path") for e in events if e.get("event") == "checkpoint_pruned"}
    checkpoints = [
        {
            "name": Path(str(e.get("path"))).name,
            "step": e.get("step"),
            "kind": e.get("kind"),
            "metric_value": e.get("metric_value"),
            "kept": e.get("path") not in pruned,
        }
        for e in events
        if e.get("event") == "checkpoint_saved"
    ]
    best = [e for e in events if e.get("event") == "best_updated"]
    best_eval = runfolder.best_evaluation(evals, events)
    started, ended = _finite(info.get("started_at")), _finite(info.get("ended_at"))
    return {
        "run_id": info.get("run_id") or run_dir.name,
        "status": info.get("status") or "unknown",
        "model": info.get("model"),
        "family": info.get("family"),
        "method": info.get("method"),
        "world_size": info.get("world_size"),
        "hosts": info.get("hosts"),
        "total_steps": info.get("total_steps"),
        "step": train[-1]["step"] if train else info.get("step"),
        "started_at": started,
        "ended_at": ended,
        "duration_seconds": round(ended - started, 1) if started and ended else None,
        "resumes": info.get("resumes", 0),
        "versions": info.get("versions") or {},
        "train_records": len(train),
        "first_loss": finite_loss[0][1] if finite_loss else None,
        "final_loss": finite_loss[-1][1] if finite_loss else None,
        "min_loss": min(finite_loss, key=lambda p: p[1]) if finite_loss else None,
        "nonfinite_steps": [r["step"] for r in train if _finite(r.get("loss")) is None],
        "skipped_steps": sum(1 for r in train if r.get("skipped") is True),
        "median_tokens_per_sec": round(statistics.median(throughput), 1) if throughput else None,
        "max_peak_mem_mb": max(memory) if memory else None,
        "evals": len(evals),
        "final_eval_loss": eval_points[-1][1] if eval_points else None,
        "best_eval": (best_eval.step, best_eval.value) if best_eval else None,
        "best_eval_metric": best_eval.metric.name if best_eval else None,
        "best_updated": best[-1] if best else None,
        "checkpoints": checkpoints,
        "errors": errors,
        "has_experts": bool(_records(run_dir, runfolder.EXPERT_LOG)),
    }


def read_data_report(run_dir: str | os.PathLike) -> dict | None:
    try:
        data = json.loads((Path(run_dir) / DATA_REPORT_JSON).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------- plots


def _plots():
    try:
        from trainer.runfolder import plots
    except ImportError as exc:
        raise ReportError(
            f"the report needs the plotting libraries ({exc.name} is missing): pip install -e .[dashboard]"
        ) from exc
    return plots


def length_figure(data_report: dict | None):
    """Histogram of token lengths per record, with max_length and p95 marked (a matplotlib Figure)."""
    plots = _plots()
    fig, ax = plots.new_axes("token length per record", "tokens", "records")
    hist = (data_report or {}).get("histogram") or {}
    edges, counts = hist.get("edges") or [], hist.get("counts") or []
    if not counts or len(edges) != len(counts) + 1:
        plots.no_data(ax, "no data_report.json (python -m trainer preprocess --analyze-only)")
        return fig
    widths = [b - a for a, b in zip(edges, edges[1:])]
    ax.bar(edges[:-1], counts, width=widths, align="edge", color=plots.COLORS[0], alpha=0.8, gid="lengths")
    max_length = data_report.get("max_length")
    if isinstance(max_length, int):
        ax.axvline(
            max_length, color="#e03131", ls="--", lw=1.2, label=f"max_length {max_length}", gid="max_length"
        )
    p95 = (data_report.get("lengths") or {}).get("p95")
    if isinstance(p95, int):
        ax.axvline(p95, color="#868e96", ls=":", lw=1.2, label=f"p95 {p95}", gid="p95")
    ax.legend(fontsize=7, loc="upper right")
    return fig


# ---------------------------------------------------------------- the page


def write_report(run_dir: str | os.PathLike) -> Path:
    """Write ``<run>/report/index.html`` and its PNGs; returns the page's path."""
    run_dir = check_run_folder(run_dir)
    plots = _plots()
    out = run_dir / REPORT_DIR
    plots.write_report(run_dir, out)
    data_report = read_data_report(run_dir)
    (out / LENGTHS_PNG).write_bytes(plots.to_png(length_figure(data_report)))
    summary = summarize(run_dir)
    page = render_html(run_dir, summary, data_report)
    index = out / INDEX
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, index)
    return index


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _when(ts) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='kv'>{body}</table>"


def _grid(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table class='grid'><tr>{head}</tr>{body}</table>"


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 900px; color: #212529; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.status { display: inline-block; padding: 0.1em 0.6em; border-radius: 4px; background: #e9ecef; }
.finished { background: #d3f9d8; } .failed { background: #ffe3e3; } .interrupted { background: #fff3bf; }
table { border-collapse: collapse; margin: 0.5em 0; } th, td { padding: 0.2em 0.8em; text-align: left; }
table.kv th { color: #495057; font-weight: normal; } table.grid td, table.grid th { border: 1px solid #dee2e6; }
img { max-width: 100%; display: block; margin: 0.6em 0; } pre { background: #f8f9fa; padding: 0.8em; overflow-x: auto; }
.muted { color: #868e96; }
"""


def render_html(run_dir: Path, s: dict, data_report: dict | None) -> str:
    title = f"Run report: {s['run_id']}"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p><span class='status {html.escape(s['status'])}'>{html.escape(s['status'])}</span> "
        f"<span class='muted'>{html.escape(str(run_dir.resolve()))}</span></p>",
        "<h2>Run</h2>",
        _table(
            [
                ("model", f"{s['model'] or '-'} ({s['family'] or '?'}, {s['method'] or '?'})"),
                ("steps", f"{_fmt(s['step'])} of {_fmt(s['total_steps'])}"),
                ("processes / hosts", f"{_fmt(s['world_size'])} / {', '.join(s['hosts'] or []) or '-'}"),
                ("started / ended", f"{_when(s['started_at'])} / {_when(s['ended_at'])}"),
                ("duration", f"{s['duration_seconds']:.0f} s" if s["duration_seconds"] is not None else "-"),
                ("resumes", _fmt(s["resumes"])),
                ("versions", ", ".join(f"{k} {v}" for k, v in s["versions"].items() if v) or "-"),
            ]
        ),
        "<h2>Results</h2>",
        _table(
            [
                ("final training loss", _fmt(s["final_loss"])),
                ("first training loss", _fmt(s["first_loss"])),
                (
                    "lowest training loss",
                    f"{_fmt(s['min_loss'][1])} at step {s['min_loss'][0]}" if s["min_loss"] else "-",
                ),
                ("final eval loss", _fmt(s["final_eval_loss"])),
                (
                    f"best evaluation ({s['best_eval_metric'] or 'eval_loss'})",
                    f"{_fmt(s['best_eval'][1])} at step {s['best_eval'][0]}" if s["best_eval"] else "-",
                ),
                ("median throughput", f"{_fmt(s['median_tokens_per_sec'])} tokens/s"),
                ("peak memory (rank 0)", f"{_fmt(s['max_peak_mem_mb'])} MiB"),
                (
                    "non-finite / skipped steps",
                    f"{len(s['nonfinite_steps'])} / {s['skipped_steps']}",
                ),
            ]
        ),
    ]
    if s["errors"]:
        last = s["errors"][-1]
        parts += [
            "<h2>Error</h2>",
            f"<p>{html.escape(str(last.get('type')))} at step {html.escape(str(last.get('step')))}: "
            f"{html.escape(str(last.get('message')))}</p>",
            f"<pre>{html.escape(str(last.get('traceback') or ''))}</pre>",
        ]
    parts.append("<h2>Plots</h2>")
    shown = [name for name in PAGE_PLOTS if name != "experts" or s["has_experts"]]
    for name in shown:
        parts.append(f"<img src='{name}.png' alt='{name} plot'>")
    parts.append(_data_section(data_report))
    if s["checkpoints"]:
        parts += [
            "<h2>Checkpoints</h2>",
            _grid(
                ["folder", "step", "kind", "metric", "kept"],
                [
                    [
                        c["name"],
                        _fmt(c["step"]),
                        str(c["kind"]),
                        _fmt(c["metric_value"]),
                        "yes" if c["kept"] else "pruned",
                    ]
                    for c in s["checkpoints"]
                ],
            ),
        ]
        if s["best_updated"]:
            b = s["best_updated"]
            parts.append(
                f"<p>best: {html.escape(str(b.get('path')))} ({html.escape(str(b.get('metric')))} "
                f"{html.escape(_fmt(b.get('metric_value')))} at step {html.escape(str(b.get('step')))})</p>"
            )
    parts.append(
        f"<p class='muted'>written {_when(time.time())} by python -m trainer report</p></body></html>"
    )
    return "\n".join(parts)


def _data_section(report: dict | None) -> str:
    if not report or not (report.get("lengths") or {}).get("count"):
        return "<h2>Data</h2><p class='muted'>no data_report.json in this run folder</p>"
    d = report["lengths"]
    parts = [
        "<h2>Data</h2>",
        f"<p>{html.escape(str(report.get('train_file')))}: {report['records_analyzed']:,} records analyzed"
        f"{' (sample)' if report.get('sampled') else ''}, max_length {report['max_length']}.</p>",
        _grid(
            ["min", "median", "p90", "p95", "p99", "max"],
            [[_fmt(d[k]) for k in ("min", "median", "p90", "p95", "p99", "max")]],
        ),
    ]
    rows = []
    for name, s in (report.get("strategies") or {}).items():
        if s.get("applicable") is False:
            rows.append([name, "n/a", "", ""])
            continue
        rows.append([name, _fmt(s["chunks"]), _fmt(s["lost_tokens"]), _fmt(s.get("unsplittable_segments"))])
    parts.append(_grid(["strategy", "chunks", "tokens lost", "unsplittable pieces"], rows))
    return "\n".join(parts)
