"""A run's status and stat cards (``/api/stats``), and every run's line in ``/api/runs``.

The stat cards read the run's refreshed logs; a line in the runs list reads only run.json and the
tails of the logs, so listing many runs stays cheap. Both share ``headline`` so they agree.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from trainer import runfolder
from trainer.runfolder.columns import finite, record_ts
from trainer.runfolder.reader import read_json_object, tail_records
from trainer.runfolder.rundata import RunData, files_mtime
from trainer.runfolder.series import last_ema
from trainer.runfolder.summaries import best_eval, kernels

from .run_tables import latest_checkpoint
from .runs import RunRegistry, StallPolicy, assess


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
            "kernels": kernels(run),
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
