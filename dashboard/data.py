"""One data function per view: the page and the JSON API both call these, so they never disagree.

Each takes a refreshed ``RunData`` (and parsed parameters) and returns plain JSON-ready values.
Non-finite numbers come back as None; records come back as the trainer wrote them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from trainer import runfolder
from trainer.runfolder import runconfig
from trainer.runfolder.columns import as_float, finite, record_ts
from trainer.runfolder.reader import read_json_object, tail_records
from trainer.runfolder.records import EvalRecord, TrainRecord
from trainer.runfolder.rundata import RunData, files_mtime
from trainer.runfolder.series import downsample_indices, last_ema
from trainer.runfolder.summaries import best_eval, checkpoint_rows, experts, kernels  # noqa: F401 - api calls data.experts

from .errors import DashboardError
from .runs import RunRegistry, StallPolicy, assess

TRAIN_FIELDS = tuple(f for f in (*TrainRecord.required(), *TrainRecord.optional()) if f != "step")
EVAL_FIELDS = tuple(f for f in EvalRecord.required() if f != "step")


def _last_ts(records: list[dict]) -> float | None:
    return record_ts(records[-1]) if records else None


def newest(times, run_dir: Path) -> float | None:
    """The latest of the given times; the logs' modification time when none is known."""
    known = [t for t in times if t is not None]
    return max(known) if known else files_mtime(run_dir)


def headline(info: dict, latest: dict, status: str, reason: str) -> dict:
    """What a run's stats and its line in /api/runs share: identity, status, position."""
    step = latest.get("step") if latest else finite(info.get("step"))
    total = finite(latest.get("total_steps")) or finite(info.get("total_steps"))
    progress = min(1.0, step / total) if isinstance(step, int) and total else None
    return {
        "run_id": info.get("run_id"),
        "status": status,
        "status_reason": reason,
        "model": info.get("model"),
        "method": info.get("method"),
        "step": step,
        "total_steps": total,
        "progress": 1.0 if progress is None and status == "finished" else progress,
        "loss": finite(latest.get("loss")),
        "started_at": finite(info.get("started_at")),
    }


# ---------------------------------------------------------------- status and stats


def last_activity(run: RunData) -> float | None:
    """Newest ``ts`` among the logs that only move while training moves (not GPU telemetry)."""
    times = [
        record_ts(run.train.latest),
        _last_ts(run.events.items),
        _last_ts(run.errors.items),
        max((w["ts"] for w in run.experts.windows.values() if math.isfinite(w["ts"])), default=None),
        max((t for t in map(record_ts, run.evals.by_key.values()) if t is not None), default=None),
        finite(run.run_json.get("updated_at")),
        finite(run.run_json.get("started_at")),
    ]
    return newest(times, run.path)


def run_status(run: RunData, policy: StallPolicy, now: float) -> tuple[str, str]:
    return assess(
        run.run_json,
        run.events.items,
        run.errors.items,
        list(run.train.recent_ts),
        last_activity(run),
        now,
        policy,
    )


def smoothed_loss(run: RunData, step: int | None) -> float | None:
    """EMA (weight 0.6, as the loss plot) of the loss up to the current step."""
    table = run.train.table
    column = table.columns.get("loss")
    if column is None or step is None:
        return None
    row = table.row_of(step)
    end = (row + 1) if row is not None else table.index_from(step)
    return finite(last_ema(column[max(0, end - 400) : end]))


def _elapsed(run: RunData, status: str, now: float) -> float | None:
    started = finite(run.run_json.get("started_at"))
    if started is None:
        first = run.train.table.columns.get("ts")
        started = first[0] if first else None
    if started is None:
        return None
    if status == "running":
        end = now
    else:
        end = finite(run.run_json.get("ended_at")) or last_activity(run) or now
    return max(0.0, end - started)


def stats(run: RunData, policy: StallPolicy, now: float | None = None) -> dict:
    """The numbers on the stat cards, and what ``curl /api/stats`` prints."""
    now = time.time() if now is None else now
    with run.lock:
        latest = run.train.latest or {}
        info = run.run_json
        status, reason = run_status(run, policy, now)
        head = headline(info, latest, status, reason)
        eta = (
            finite(latest.get("eta_seconds"))
            if status == "running"
            else (0.0 if status == "finished" else None)
        )
        last_ckpt = latest_checkpoint(run)
        latest_ts = record_ts(latest)
        nonfinite = latest.get("nonfinite") if isinstance(latest.get("nonfinite"), list) else []
        return {
            "run": run.name,
            **head,
            "epoch": finite(latest.get("epoch")),
            "loss_nonfinite": "loss" in nonfinite,
            "loss_smoothed": smoothed_loss(run, head["step"]),
            "best_eval": best_eval(run),
            "lr": finite(latest.get("lr")),
            "grad_norm": finite(latest.get("grad_norm")),
            "tokens_per_sec": finite(latest.get("tokens_per_sec")),
            "steps_per_sec": finite(latest.get("steps_per_sec")),
            "eta_seconds": eta,
            "eta_at": (latest_ts + eta) if eta is not None and latest_ts is not None else None,
            "elapsed_seconds": _elapsed(run, status, now),
            "train_elapsed_seconds": finite(latest.get("elapsed")),
            "peak_mem_mb": finite(latest.get("peak_mem_mb")),
            "last_record_at": latest_ts,
            "last_record_age_seconds": (now - latest_ts) if latest_ts is not None else None,
            "last_checkpoint": last_ckpt,
            "error_count": len(run.errors.items),
            "nonfinite_steps": run.train.nonfinite_records,
            "skipped_steps": run.train.skipped_steps,
            "bad_lines": run.bad_lines(),
            "resumes": sum(1 for e in run.events.items if e.get("event") == "resume"),
            "records": run.train.table.rows,
            "versions": run.versions(),
            "kernels": kernels(run),  # trainer.runfolder.summaries
            "output_dir": info.get("output_dir") if isinstance(info.get("output_dir"), str) else None,
        }


def run_summary(name: str, path: Path, root: Path, policy: StallPolicy, now: float) -> dict:
    """A run's line in /api/runs, from run.json and the tails of its logs (cheap for many runs)."""
    logs = path / runfolder.LOGS_DIR
    info = read_json_object(path / runfolder.RUN_JSON, root)
    train = [r for r in tail_records(logs / runfolder.TRAINING_LOG, root) if isinstance(r.get("step"), int)]
    events = tail_records(logs / runfolder.EVENTS_LOG, root)
    errors = tail_records(logs / runfolder.ERROR_LOG, root)
    latest = train[-1] if train else {}
    train_ts = [t for t in map(record_ts, train) if t is not None]
    times = [
        record_ts(latest),
        _last_ts(events),
        _last_ts(errors),
        finite(info.get("updated_at")),
        finite(info.get("started_at")),
    ]
    activity = newest(times, path)
    status, reason = assess(info, events, errors, train_ts, activity, now, policy)
    return {
        "name": name,
        **headline(info, latest, status, reason),
        "last_activity": activity,
        "tokens_per_sec": finite(latest.get("tokens_per_sec")),
    }


def runs(registry: RunRegistry, policy: StallPolicy, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    found = registry.runs()
    return {
        "latest": next(iter(found), None),
        "runs": [run_summary(name, path, registry.root, policy, now) for name, path in found.items()],
    }


# ---------------------------------------------------------------- series


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


def available_fields(run: RunData) -> list[str]:
    return sorted(set(run.train.table.fields()) | set(TRAIN_FIELDS))


def metrics(run: RunData, fields: list[str], log: str, since_step: int, max_points: int) -> dict:
    """Series ``[[wall_time, step, value], ...]`` per field, downsampled (first and last kept)."""
    with run.lock:
        reader = _train_series if log == "train" else _eval_series
        series = reader(run, fields, since_step, max_points)
        steps = run.train.table.steps if log == "train" else [r["step"] for r in run.evals.records()]
        return {
            "run": run.name,
            "log": log,
            "since_step": since_step,
            "max_points": max_points,
            "last_step": steps[-1] if len(steps) else None,
            "fields": available_fields(run) if log == "train" else None,
            "series": series,
        }


def metrics_csv(result: dict) -> str:
    lines = ["field,wall_time,step,value"]
    for name, data in result["series"].items():
        for wall, step, value in data["points"]:
            lines.append(f"{name},{'' if wall is None else wall},{step},{'' if value is None else value}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- evals, events, errors


def evals(run: RunData) -> dict:
    with run.lock:
        records = run.evals.records()
        return {"run": run.name, "count": len(records), "best": best_eval(run), "evals": records}


def events(run: RunData, kinds: set[str] | None, limit: int, since_ts: float | None) -> dict:
    """Events in file order (oldest first), the newest ``limit`` of those that match."""
    with run.lock:
        items = run.events.items
        counts: dict[str, int] = {}
        for item in items:
            counts[item["event"]] = counts.get(item["event"], 0) + 1
        chosen = [
            e
            for e in items
            if (kinds is None or e["event"] in kinds)
            and (since_ts is None or (record_ts(e) or 0.0) > since_ts)
        ]
        return {
            "run": run.name,
            "total": len(items),
            "matched": len(chosen),
            "counts": counts,
            "events": chosen[-limit:],
        }


def errors(run: RunData) -> dict:
    with run.lock:
        return {
            "run": run.name,
            "count": len(run.errors.items),
            "errors": list(run.errors.items),
            "bad_lines": run.bad_lines(),
        }


# ---------------------------------------------------------------- checkpoints


def checkpoints(run: RunData) -> dict:
    with run.lock:
        rows = checkpoint_rows(run)
        best = next((r["name"] for r in rows if r["best"]), None)
        return {
            "run": run.name,
            "checkpoints": rows,
            "best": best,
            "on_disk": sum(r["on_disk"] for r in rows),
            "pruned": sum(r["pruned"] for r in rows),
        }


def latest_checkpoint(run: RunData) -> dict | None:
    rows = [r for r in checkpoint_rows(run) if r["step"] is not None]
    if not rows:
        return None
    last = max(rows, key=lambda r: (r["step"], r["ts"] or 0.0))
    return {k: last[k] for k in ("name", "step", "ts", "on_disk", "best")}


# ---------------------------------------------------------------- gpu


def gpu(
    run: RunData, fields: list[str] | None, since_ts: float | None, max_points: int, with_series: bool
) -> dict:
    """The latest sample per device, and (optionally) each device's series ``[[ts, value], ...]``."""
    with run.lock:
        devices = [{"key": key, **record} for key, record in sorted(run.gpu.latest.items())]
        result = {"run": run.name, "devices": devices}
        if with_series:
            result["series"] = {
                key: _device_series(cols, fields, since_ts, max_points)
                for key, cols in sorted(run.gpu.series.items())
            }
        return result


def gpu_csv(result: dict) -> str:
    """``device,field,wall_time,value`` rows of every device's series."""
    lines = ["device,field,wall_time,value"]
    for device, fields in result.get("series", {}).items():
        for name, data in fields.items():
            for wall, value in data["points"]:
                lines.append(f"{device},{name},{wall},{'' if value is None else value}")
    return "\n".join(lines) + "\n"


def _device_series(cols, fields: list[str] | None, since_ts: float | None, max_points: int) -> dict:
    ts_col = cols.columns.get("ts")
    if ts_col is None:
        return {}
    ts = np.frombuffer(ts_col, dtype=float).copy()
    start = int(np.searchsorted(ts, since_ts, side="right")) if since_ts is not None else 0
    ts = ts[start:]
    names = fields if fields is not None else [n for n in cols.columns if n != "ts"]
    out = {}
    for name in names:
        column = cols.columns.get(name)
        if column is None:
            continue
        values = np.frombuffer(column, dtype=float)[start:].copy()
        keep = downsample_indices(values, max_points)
        out[name] = {
            "points": [
                [t, v if math.isfinite(v) else None] for t, v in zip(ts[keep].tolist(), values[keep].tolist())
            ],
            "total": len(values),
            "dropped": len(values) - len(keep),
        }
    return out


# ---------------------------------------------------------------- chart series (columnar)


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
        all_steps = run.train.table.steps if log == "train" else [r["step"] for r in run.evals.records()]
        return {
            "run": run.name,
            "log": log,
            "since_step": since_step,
            "max_points": max_points,
            "last_step": all_steps[-1] if len(all_steps) else None,
            "total": len(steps),
            "dropped": len(steps) - len(keep),
            "started_at": finite(run.run_json.get("started_at")),
            "fields": available,
            "step": steps[keep].tolist(),
            "wall": _column_list(wall[keep]),
            "tokens_seen": _column_list(seen[keep]) if seen is not None else None,
            "series": {f: _column_list(c[keep]) for f, c in columns.items()},
        }


# ---------------------------------------------------------------- config and comparison


def config_view(registry: RunRegistry, names: list[str], everything: bool) -> dict:
    """The saved config of one run (every key), or of several (only the keys that differ, unless
    ``everything``): ``keys`` and per key the value in each run, in the order the runs were given."""
    chosen = [registry.get(name) for name in names] if names else [registry.get(None)]
    configs = [runconfig.read_config(run.path, registry.root) for run in chosen]
    if len(configs) == 1 or everything:
        keys = sorted(set().union(*configs))
    else:
        keys = runconfig.differing(configs)
    return {
        "runs": [run.name for run in chosen],
        "found": [bool(c) for c in configs],
        "keys": keys,
        "values": {k: [c.get(k) for c in configs] for k in keys},
        "total_keys": len(set().union(*configs)),
    }
