"""What a run folder says about its run, for ``list`` and ``export``: status, steps, best evaluation,
data, size. Reads logs through trainer.runfolder and config.yaml through trainer.config's models (no torch).
"""

from __future__ import annotations

from pathlib import Path

from trainer import runfolder
from trainer.runfolder.liveness import effective_status, process_alive  # noqa: F401 - list's rule, shared


def find_runs(root: Path) -> list[Path]:
    """Run folders under root (the run-folder library's discovery, as the dashboard and ``aggregate`` use)."""
    return sorted(runfolder.find_run_folders(Path(root)).values())


def eval_section(run_dir: Path) -> dict:
    """The ``eval`` section of the run's config.yaml, read through the config models ({} when unreadable)."""
    from trainer.config import read_run_config

    config, _ignored = read_run_config(run_dir / runfolder.CONFIG_YAML)  # keys of older versions are ignored
    return config.to_dict()["eval"] if config is not None else {}


def best_metric(run_dir: Path) -> dict | None:
    """The run's best evaluation by the one rule (``trainer.runfolder.best``), as ``{name, value, step}``."""
    evals = list(runfolder.iter_records(runfolder.log_path(run_dir, runfolder.EVAL_LOG)))
    events = runfolder.iter_records(runfolder.log_path(run_dir, runfolder.EVENTS_LOG))
    section = eval_section(run_dir)
    task = section.get("task") if isinstance(section.get("task"), str) else None
    best = runfolder.best_evaluation(evals, events, runfolder.config_metric(section), task)
    if best is None:
        return None
    return {"name": best.metric.name, "value": best.value, "step": best.step}


def describe(run_dir: Path, root: Path, now: float) -> dict:
    info = runfolder.read_run_json(run_dir)
    step = info.get("step")
    if step is None:
        records = list(runfolder.iter_records(run_dir / runfolder.LOGS_DIR / runfolder.TRAINING_LOG))
        step = records[-1].get("step") if records else None
    last_seen = info.get("updated_at") or info.get("started_at")
    try:
        last_seen = last_seen or (run_dir / runfolder.RUN_JSON).stat().st_mtime
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
        "size_bytes": runfolder.folder_size(run_dir),
        "started_at": info.get("started_at"),
        "updated_at": last_seen,
        "age_seconds": round(now - last_seen, 1) if isinstance(last_seen, (int, float)) else None,
    }


def data_report(run_dir: Path) -> dict:
    """The run's last ``data_report`` event (record and sequence counts), or {}."""
    reports = [
        e
        for e in runfolder.iter_records(run_dir / runfolder.LOGS_DIR / runfolder.EVENTS_LOG)
        if e.get("event") == "data_report"
    ]
    return reports[-1] if reports else {}
