"""What a run folder says about its run, for ``list`` and ``export``: status, steps, best evaluation,
data, size. Reads logs through trainer.runlog and config.yaml through trainer.config's models (no torch).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from trainer import runlog


def find_runs(root: Path) -> list[Path]:
    """Run folders (a run.json inside) directly under root or one level down (sweeps group runs)."""
    found = {p.parent for pattern in ("*/run.json", "*/*/run.json") for p in root.glob(pattern)}
    if (root / runlog.RUN_JSON).is_file():
        found.add(root)
    return sorted(found)


def lower_is_better(name: str) -> bool:
    return name in ("eval_loss", "perplexity") or name.endswith("loss")


def eval_settings(run_dir: Path) -> tuple[str, bool]:
    """The metric the run ranks evaluations by, and whether higher is better.

    From its config.yaml; ``auto`` (the task's metric, else eval_loss) is resolved by the metric the
    trainer named in its checkpoint events, and an unset direction by the metric's name.
    """
    from trainer.config import EvalConfig, read_run_config

    config, _ = read_run_config(run_dir / runlog.CONFIG_YAML)  # keys of older versions are ignored
    section = config.eval if config else EvalConfig()
    metric = section.metric_for_best or "auto"
    if metric == "auto":
        named = [
            e.get("metric")
            for e in runlog.iter_records(run_dir / runlog.LOGS_DIR / runlog.EVENTS_LOG)
            if e.get("event") in ("best_updated", "checkpoint_saved") and isinstance(e.get("metric"), str)
        ]
        metric = named[-1] if named else "eval_loss"
    greater = section.greater_is_better
    if greater is None:
        greater = not lower_is_better(str(metric))
    return str(metric), greater


def best_metric(run_dir: Path) -> dict | None:
    metric, greater = eval_settings(run_dir)
    best = None
    records = runlog.iter_records(run_dir / runlog.LOGS_DIR / runlog.EVAL_LOG)
    for record in runlog.last_per_step(list(records)):
        value = record.get(metric, (record.get("metrics") or {}).get(metric))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if best is None or (value > best["value"] if greater else value < best["value"]):
            best = {"name": metric, "value": value, "step": record.get("step")}
    return best


def process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def effective_status(info: dict) -> str:
    """run.json says running; if its process is gone from this host, the run died without a word."""
    status = info.get("status") or "unknown"
    hosts = info.get("hosts") or []
    if status == "running" and hosts == [socket.gethostname()] and not process_alive(info.get("pid")):
        return "dead"
    return status


def disk_size(run_dir: Path) -> int:
    total = 0
    for path in run_dir.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            continue  # a checkpoint renamed or pruned while we walk
    return total


def describe(run_dir: Path, root: Path, now: float) -> dict:
    info = runlog.read_run_json(run_dir)
    step = info.get("step")
    if step is None:
        records = list(runlog.iter_records(run_dir / runlog.LOGS_DIR / runlog.TRAINING_LOG))
        step = records[-1].get("step") if records else None
    last_seen = info.get("updated_at") or info.get("started_at")
    try:
        last_seen = last_seen or (run_dir / runlog.RUN_JSON).stat().st_mtime
    except OSError:
        last_seen = None
    return {
        "name": str(run_dir.relative_to(root)) if run_dir != root else run_dir.name,
        "path": str(run_dir),
        "run_id": info.get("run_id"),
        "status": effective_status(info),
        "model": info.get("model"),
        "family": info.get("family"),
        "method": info.get("method"),
        "step": step,
        "total_steps": info.get("total_steps"),
        "best": best_metric(run_dir),
        "size_bytes": disk_size(run_dir),
        "started_at": info.get("started_at"),
        "updated_at": last_seen,
        "age_seconds": round(now - last_seen, 1) if isinstance(last_seen, (int, float)) else None,
    }


def data_report(run_dir: Path) -> dict:
    """The run's last ``data_report`` event (record and sequence counts), or {}."""
    reports = [
        e
        for e in runlog.iter_records(run_dir / runlog.LOGS_DIR / runlog.EVENTS_LOG)
        if e.get("event") == "data_report"
    ]
    return reports[-1] if reports else {}
