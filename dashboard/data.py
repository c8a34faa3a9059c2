"""One data function per view: the page and the JSON API both call these, so they never disagree.

Each takes a refreshed ``RunData`` (and parsed parameters) and returns plain JSON-ready values.
Non-finite numbers come back as None; records come back as the trainer wrote them.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path, PurePosixPath

import numpy as np

from trainer import runlog

from .columns import as_float, finite, record_ts
from .errors import DashboardError
from .reader import inside, tail_records
from .rundata import RunData, files_mtime, read_json_under
from .runs import RunRegistry, StallPolicy, assess
from .series import downsample_indices, last_ema

TRAIN_FIELDS = tuple(f for f in runlog.REQUIRED_FIELDS[runlog.TRAINING_LOG] if f != "step") + (
    "aux_loss",
    "skipped",
)
EVAL_FIELDS = ("ts", "eval_loss", "perplexity", "eval_tokens")


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


def best_eval(run: RunData) -> dict | None:
    """The evaluation flagged ``is_best`` last, else the lowest finite eval_loss."""
    records = run.evals.records()
    flagged = [r for r in records if r.get("is_best") is True]
    if flagged:
        best = flagged[-1]
    else:
        scored = [r for r in records if finite(r.get("eval_loss")) is not None]
        if not scored:
            return None
        best = min(scored, key=lambda r: r["eval_loss"])
    return {
        "step": best.get("step"),
        "eval_loss": finite(best.get("eval_loss")),
        "perplexity": finite(best.get("perplexity")),
        "metrics": best.get("metrics") if isinstance(best.get("metrics"), dict) else None,
        "task": best.get("task"),
    }


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
        }


def run_summary(name: str, path: Path, root: Path, policy: StallPolicy, now: float) -> dict:
    """A run's line in /api/runs, from run.json and the tails of its logs (cheap for many runs)."""
    logs = path / runlog.LOGS_DIR
    info = read_json_under(path / runlog.RUN_JSON, root)
    train = [r for r in tail_records(logs / runlog.TRAINING_LOG, root) if isinstance(r.get("step"), int)]
    events = tail_records(logs / runlog.EVENTS_LOG, root)
    errors = tail_records(logs / runlog.ERROR_LOG, root)
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
    return {"name": name, **headline(info, latest, status, reason), "last_activity": activity}


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


def _train_series(run: RunData, fields: list[str], since_step: int, max_points: int) -> dict:
    table = run.train.table
    unknown = [f for f in fields if f not in table.columns and f not in TRAIN_FIELDS]
    if unknown:
        raise DashboardError(
            400,
            f"unknown field(s) {', '.join(unknown)} in the training log; fields: {', '.join(available_fields(run))}",
        )
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


def _folder_size(path: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            file_path = os.path.join(folder, name)
            if os.path.islink(file_path):
                continue
            try:
                total += os.stat(file_path).st_size
            except OSError:
                pass
    return total


def _name_from_path(path, fallback: str) -> str:
    return PurePosixPath(path).name if isinstance(path, str) and path else fallback


def checkpoint_rows(run: RunData) -> list[dict]:
    """Checkpoints from checkpoint_saved/pruned events and the folders on disk, by step."""
    folders = run.checkpoint_folders()
    rows: dict[str, dict] = {}
    pruned_names: set[str] = set()
    for event in run.events.items:
        kind = event["event"]
        step = event.get("step") if isinstance(event.get("step"), int) else None
        if kind == "checkpoint_saved":
            name = _name_from_path(event.get("path"), f"{runlog.CHECKPOINT_PREFIX}{step}")
            rows[name] = {
                "name": name,
                "step": step if step is not None else runlog.checkpoint_step(name),
                "ts": record_ts(event),
                "size_bytes": finite(event.get("size_bytes")),
                "metric": event.get("metric"),
                "metric_value": finite(event.get("metric_value")),
                "kind": event.get("kind"),
            }
            pruned_names.discard(name)
        elif kind == "checkpoint_pruned":
            pruned_names.add(_name_from_path(event.get("path"), f"{runlog.CHECKPOINT_PREFIX}{step}"))
    for name, folder in folders.items():
        if name not in rows:
            rows[name] = _row_from_folder(run, name, folder)
    for name in pruned_names - rows.keys():
        rows[name] = {
            "name": name,
            "step": runlog.checkpoint_step(name),
            "ts": None,
            "size_bytes": None,
            "metric": None,
            "metric_value": None,
            "kind": None,
        }
    best_name, best_step = _best_checkpoint(run, rows)
    for name, row in rows.items():
        row["on_disk"] = name in folders
        row["pruned"] = name in pruned_names or not row["on_disk"]
        row["best"] = name == best_name or (
            best_name is None and best_step is not None and row["step"] == best_step
        )
    return sorted(rows.values(), key=lambda r: (r["step"] if r["step"] is not None else -1, r["name"]))


def _row_from_folder(run: RunData, name: str, folder: dict) -> dict:
    """A checkpoint folder no event told us about: its trainer_state.json and size on disk."""
    cache_key = (name, folder["mtime"])
    cached = run.folder_cache.get(cache_key)
    if cached is None:
        state = read_json_under(folder["path"] / runlog.TRAINER_STATE, run.root)
        size = _folder_size(folder["path"]) if inside(folder["path"], run.root) else None
        cached = run.folder_cache[cache_key] = (state, size)
    state, size = cached
    final = name.startswith(runlog.FINAL_PREFIX)
    return {
        "name": name,
        "step": folder["step"],
        "ts": finite(state.get("ts")) or folder["mtime"],
        "size_bytes": size,
        "metric": state.get("metric"),
        "metric_value": finite(state.get("metric_value")),
        "kind": "final" if final else None,
    }


def _best_checkpoint(run: RunData, rows: dict[str, dict]) -> tuple[str | None, int | None]:
    """The last best_updated event names the best checkpoint (by folder name, else by step)."""
    for event in reversed(run.events.items):
        if event["event"] == "best_updated":
            step = event.get("step") if isinstance(event.get("step"), int) else None
            name = _name_from_path(event.get("path"), "")
            return (name if name in rows else None), step
    best = best_eval(run)
    return None, (best["step"] if best else None)


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


# ---------------------------------------------------------------- experts


def experts(run: RunData, window: str, from_step: int | None, to_step: int | None) -> dict:
    """Expert selection per layer summed over the chosen windows: counts, fractions, balance.

    ``window``: ``latest`` (the last logged window), ``all``, or ``range`` with
    ``from_step``/``to_step`` (windows whose end step falls in it, inclusive).
    """
    with run.lock:
        steps = run.experts.steps()
        if window == "latest":
            chosen = steps[-1:]
        elif window == "all":
            chosen = steps
        else:
            lo = from_step if from_step is not None else 0
            hi = to_step if to_step is not None else math.inf
            chosen = [s for s in steps if lo <= s <= hi]
        windows = [run.experts.windows[s] for s in chosen]
        layers = _sum_layers(windows)
        first = windows[0] if windows else {}
        last = windows[-1] if windows else {}
        return {
            "run": run.name,
            "window": window,
            "windows": len(windows),
            "available_steps": steps,
            "from_step": first.get("start_step"),
            "to_step": last.get("step"),
            "num_experts": last.get("num_experts"),
            "top_k": last.get("top_k"),
            "layers": layers,
            "matrix": [layer["fractions"] for layer in layers],
        }


def _sum_layers(windows: list[dict]) -> list[dict]:
    totals: dict[int, dict] = {}
    for window in windows:
        for layer in window["layers"]:
            entry = totals.setdefault(
                layer["layer"], {"layer": layer["layer"], "name": layer["name"], "counts": []}
            )
            counts = entry["counts"]
            if len(counts) < len(layer["counts"]):
                counts.extend([0.0] * (len(layer["counts"]) - len(counts)))
            for i, value in enumerate(layer["counts"]):
                counts[i] += value
    return [_balance(totals[k]) for k in sorted(totals)]


def _balance(entry: dict) -> dict:
    counts = entry["counts"]
    total = sum(counts)
    fractions = [c / total if total else 0.0 for c in counts]
    mean = total / len(counts) if counts else 0.0
    entropy = -sum(f * math.log(f) for f in fractions if f > 0)
    return {
        **entry,
        "counts": [int(c) if float(c).is_integer() else c for c in counts],
        "fractions": fractions,
        "selections": total,
        "imbalance": (max(counts) / mean) if mean else None,
        "entropy": entropy,
        "max_entropy": math.log(len(counts)) if counts else None,
    }
