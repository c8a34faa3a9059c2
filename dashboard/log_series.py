"""The training and eval logs as series: ``/api/metrics`` points and ``/api/series`` chart columns.

Both cut at ``since_step`` so live updates fetch only what is new, and both downsample honestly
(first and last kept, the number dropped said). Non-finite numbers come back as None.
"""

from __future__ import annotations

import math

import numpy as np

from trainer.runfolder.columns import as_float, finite
from trainer.runfolder.records import EvalRecord, TrainRecord
from trainer.runfolder.rundata import RunData
from trainer.runfolder.series import downsample_indices

from .errors import DashboardError

TRAIN_FIELDS = tuple(f for f in (*TrainRecord.required(), *TrainRecord.optional()) if f != "step")
EVAL_FIELDS = tuple(f for f in EvalRecord.required() if f != "step")


# ---------------------------------------------------------------- points (/api/metrics)


def _points(ts, steps, values: np.ndarray, max_points: int, offset: int = 0) -> tuple[list, int]:
    """``[[wall_time, step, value], ...]`` at the kept indices; ``ts``/``steps`` indexed from ``offset``.

    Only the value column is copied; wall times and steps are read at the kept rows alone.
    """
    keep = downsample_indices(values, max_points).tolist()
    kept = values[keep].tolist()
    points = [
        [None if ts is None else finite(ts[offset + i]), steps[offset + i], v if math.isfinite(v) else None]
        for i, v in zip(keep, kept)
    ]
    return points, len(values) - len(keep)


def check_train_fields(run: RunData, fields: list[str]) -> None:
    """A field the training log has never had is a 400 naming the fields it has."""
    unknown = [f for f in fields if f not in run.train.table.columns and f not in TRAIN_FIELDS]
    if unknown:
        raise DashboardError(
            400,
            f"unknown field(s) {', '.join(unknown)} in the training log; fields: {', '.join(available_fields(run))}",
        )


def _train_series(run: RunData, fields: list[str], since_step: int, max_points: int) -> dict:
    table = run.train.table
    check_train_fields(run, fields)
    start = table.index_from(since_step)
    ts = table.columns.get("ts")
    series = {}
    for name in fields:
        column = table.columns.get(name)
        values = np.frombuffer(column[start:], dtype=float) if column is not None else np.empty(0)
        points, dropped = _points(ts, table.steps, values, max_points, start) if len(values) else ([], 0)
        series[name] = {"points": points, "total": len(values), "dropped": dropped}
    return series


def flatten_eval(record: dict) -> dict[str, float]:
    """An eval record's numbers, task metrics as ``metrics.<name>``."""
    flat = {
        k: as_float(v) for k, v in record.items() if isinstance(v, (int, float, type(None))) and k != "step"
    }
    metrics = record.get("metrics")
    if isinstance(metrics, dict):
        flat.update(
            {
                f"metrics.{k}": as_float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float, type(None)))
            }
        )
    return flat


def _eval_series(run: RunData, fields: list[str], since_step: int, max_points: int) -> dict:
    records = [r for r in run.evals.records() if r["step"] >= since_step]
    flats = [flatten_eval(r) for r in records]
    known = set(EVAL_FIELDS).union(*[f.keys() for f in flats]) if flats else set(EVAL_FIELDS)
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise DashboardError(
            400, f"unknown field(s) {', '.join(unknown)} in the eval log; fields: {', '.join(sorted(known))}"
        )
    steps = [r["step"] for r in records]
    ts = [f.get("ts", math.nan) for f in flats]
    series = {}
    for name in fields:
        values = np.array([f.get(name, math.nan) for f in flats], dtype=float)
        points, dropped = _points(ts, steps, values, max_points) if len(values) else ([], 0)
        series[name] = {"points": points, "total": len(values), "dropped": dropped}
    return series


def _answer_head(run: RunData, log: str, since_step: int, max_points: int) -> dict:
    """What both answers open with: the request as understood, and the log's newest step (to poll from)."""
    steps = run.train.table.steps if log == "train" else [r["step"] for r in run.evals.records()]
    return {
        "run": run.name,
        "log": log,
        "since_step": since_step,
        "max_points": max_points,
        "last_step": steps[-1] if len(steps) else None,
    }


def available_fields(run: RunData) -> list[str]:
    return sorted(set(run.train.table.fields()) | set(TRAIN_FIELDS))


def metrics(run: RunData, fields: list[str], log: str, since_step: int, max_points: int) -> dict:
    """Series ``[[wall_time, step, value], ...]`` per field, downsampled (first and last kept)."""
    with run.lock:
        reader = _train_series if log == "train" else _eval_series
        series = reader(run, fields, since_step, max_points)
        return {
            **_answer_head(run, log, since_step, max_points),
            "fields": available_fields(run) if log == "train" else None,
            "series": series,
        }


def metrics_csv(result: dict) -> str:
    lines = ["field,wall_time,step,value"]
    for name, data in result["series"].items():
        for wall, step, value in data["points"]:
            lines.append(f"{name},{'' if wall is None else wall},{step},{'' if value is None else value}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- chart columns (/api/series)


def tokens_seen(run: RunData, start: int = 0) -> np.ndarray | None:
    """Cumulative target tokens per training row from row ``start`` on (the x axis "tokens").

    The running total lives in the run's table between polls, so a poll for new steps costs the new rows.
    """
    totals = run.train.table.running_total("tokens", start)
    return None if totals is None else np.frombuffer(totals, dtype=float)


def _kept_rows(columns: list[np.ndarray], max_points: int) -> np.ndarray:
    """Rows to send for several fields sharing one x: the union of each field's picks (first,
    last, each bucket's lowest and highest), each field with its share of ``max_points``."""
    n = len(columns[0]) if columns else 0
    if max_points <= 0 or n <= max_points:
        return np.arange(n)
    share = max(4, max_points // max(1, len(columns)))
    return np.unique(np.concatenate([downsample_indices(c, share) for c in columns]))


def _column_list(values: np.ndarray) -> list:
    return [v if math.isfinite(v) else None for v in values.tolist()]


def series(run: RunData, fields: list[str], log: str, since_step: int, max_points: int) -> dict:
    """Chart-ready columns: ``step``, ``wall`` (Unix s), ``tokens_seen`` and one list per field,
    row-aligned (uPlot's data layout), rows from ``since_step`` on, downsampled to about ``max_points``."""
    with run.lock:
        if log == "train":
            table = run.train.table
            check_train_fields(run, fields)
            start = table.index_from(since_step)
            steps = np.frombuffer(table.steps, dtype=np.int64)[start:]
            ts = table.columns.get("ts")
            wall = np.frombuffer(ts, dtype=float)[start:] if ts is not None else np.full(len(steps), np.nan)
            columns = {
                f: (
                    np.frombuffer(table.columns[f], dtype=float)[start:]
                    if f in table.columns
                    else np.full(len(steps), np.nan)
                )
                for f in fields
            }
            seen = tokens_seen(run, start)
            available = available_fields(run)
        else:
            _eval_series(run, fields, 0, 2)
            records = [r for r in run.evals.records() if r["step"] >= since_step]
            flats = [flatten_eval(r) for r in records]
            steps = np.array([r["step"] for r in records], dtype=np.int64)
            wall = np.array([f.get("ts", math.nan) for f in flats], dtype=float)
            columns = {f: np.array([x.get(f, math.nan) for x in flats], dtype=float) for f in fields}
            seen = None
            available = (
                sorted(set(EVAL_FIELDS).union(*[f.keys() for f in flats])) if flats else list(EVAL_FIELDS)
            )
        keep = _kept_rows(list(columns.values()), max_points)
        return {
            **_answer_head(run, log, since_step, max_points),
            "total": len(steps),
            "dropped": len(steps) - len(keep),
            "started_at": finite(run.run_json.get("started_at")),
            "fields": available,
            "step": steps[keep].tolist(),
            "wall": _column_list(wall[keep]),
            "tokens_seen": _column_list(seen[keep]) if seen is not None else None,
            "series": {f: _column_list(c[keep]) for f, c in columns.items()},
        }
