"""The runs overview: every run under the log root in one sortable table (``/runs``, ``/api/overview``).

Status and progress come from the same cheap per-run summary as /api/runs; the best metric is the
run's best evaluation by the one rule (``trainer.runfolder.best``, as the run page, ``list`` and
``aggregate`` pick it); the sweep a run belongs to comes from the ``sweep.json`` files under the
root (trainer/sweep writes them). The page and the API call the same ``overview`` function.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flask import Blueprint, current_app, jsonify, render_template, request

from trainer import runfolder
from trainer.runfolder import runconfig
from trainer.runfolder.best import record_task
from trainer.runfolder.columns import finite
from trainer.runfolder.discovery import find_sweeps, sweep_jobs, sweep_name
from trainer.runfolder.reader import read_json_object, tail_records

from .errors import choice_arg
from .run_stats import run_summary
from .runs import RunRegistry, StallPolicy

bp = Blueprint("overview", __name__)

EVAL_TAIL_BYTES = 4 << 20  # evaluation logs are short; this holds thousands of evaluations
HYPERPARAMETERS = ("method", "model", "lora_r", "learning_rate", "effective_batch")
SORT_KEYS = (
    "name",
    "sweep",
    "status",
    "progress",
    "best",
    *HYPERPARAMETERS,
    "tokens_per_sec",
    "step",
    "started_at",
    "last_activity",
)
NUMERIC_KEYS = (
    "progress",
    "best",
    "lora_r",
    "learning_rate",
    "effective_batch",
    "tokens_per_sec",
    "step",
    "started_at",
    "last_activity",
)
COLUMNS = (
    ("name", "run"),
    ("sweep", "sweep"),
    ("status", "status"),
    ("progress", "progress"),
    ("best", "best metric"),
    ("method", "method"),
    ("model", "model"),
    ("lora_r", "LoRA r"),
    ("learning_rate", "learning rate"),
    ("effective_batch", "eff. batch"),
    ("tokens_per_sec", "tokens/s"),
    ("step", "step"),
    ("started_at", "started"),
    ("last_activity", "last activity"),
)


def sweep_index(root: Path) -> tuple[dict[str, dict], list[dict]]:
    """(run folder's real path -> its sweep.json job entry with ``sweep``, one summary per sweep)."""
    sweeps = find_sweeps(root, confine=True)
    membership = sweep_jobs(sweeps)
    rows = []
    for path, summary in sweeps:
        counts = summary.get("counts") if isinstance(summary.get("counts"), dict) else {}
        rows.append(
            {
                "sweep": sweep_name(path, summary),
                "folder": str(path.parent.relative_to(root)) if path.parent != root else ".",
                "status": summary.get("status"),
                "jobs": len(summary["jobs"]),
                "counts": {k: v for k, v in counts.items() if isinstance(v, int)},
                "updated_at": finite(summary.get("updated_at")),
            }
        )
    return membership, rows


def best_of(path: Path, root: Path) -> dict | None:
    """The run's best evaluation from the tails of its eval log and events (cheap for many runs)."""
    logs = path / runfolder.LOGS_DIR
    evals = tail_records(logs / runfolder.EVAL_LOG, root, EVAL_TAIL_BYTES)
    events = tail_records(logs / runfolder.EVENTS_LOG, root)  # only folders without the eval stamp need them
    best = runfolder.best_evaluation(evals, events)
    if best is None:
        return None
    return {
        "metric": best.metric.name,
        "value": best.value,
        "step": best.step,
        "task": record_task(evals),
        "greater_is_better": best.metric.greater_is_better,
    }


def _sort_value(row: dict, key: str):
    if key == "best":
        return (row["best"] or {}).get("value")
    return row.get(key)


def sort_rows(rows: list[dict], key: str, order: str) -> list[dict]:
    """Sorted by ``key``; rows without a value go last either way."""
    present = [r for r in rows if _sort_value(r, key) is not None]
    missing = [r for r in rows if _sort_value(r, key) is None]
    numeric = key in NUMERIC_KEYS
    present.sort(
        key=lambda r: (_sort_value(r, key) if numeric else str(_sort_value(r, key)).lower(), r["name"]),
        reverse=order == "desc",
    )
    return present + sorted(missing, key=lambda r: r["name"])


def overview(
    registry: RunRegistry, policy: StallPolicy, sort: str = "started_at", order: str = "desc", now=None
) -> dict:
    """Every run: status, progress, best metric, sweep, hyperparameters from its saved config
    (``trainer.runfolder.runconfig.hyperparameters``), tokens/s; plus each sweep's counts."""
    now = time.time() if now is None else now
    root = registry.root
    membership, sweeps = sweep_index(root)
    rows = []
    for name, path in registry.runs().items():
        summary = run_summary(name, path, root, policy, now)
        summary["best"] = best_of(path, root)
        job = membership.get(os.path.realpath(path))
        summary["sweep"] = job["sweep"] if job else None
        info = read_json_object(path / runfolder.RUN_JSON, root)
        # SLURM job id, queue state (as `sweep status` last saw it) and attempt; None outside SLURM
        summary["slurm"] = runfolder.slurm_row(info, job)
        summary.update(runconfig.hyperparameters(runconfig.read_config(path, root), info))
        rows.append(summary)
    return {
        "root": str(root),
        "count": len(rows),
        "sort": sort,
        "order": order,
        "runs": sort_rows(rows, sort, order),
        "sweeps": sweeps,
    }


def sort_args() -> tuple[str, str]:
    sort = choice_arg(request.args, "sort", SORT_KEYS, "started_at")
    default_order = "desc" if sort in NUMERIC_KEYS else "asc"
    return sort, choice_arg(request.args, "order", ("asc", "desc"), default_order)


def _state():
    return current_app.extensions["dashboard"]


@bp.get("/api/overview")
def api_overview():
    """Every run under the log root; ``sort`` (one of SORT_KEYS) and ``order`` (asc/desc)."""
    return jsonify(overview(_state().registry, _state().policy, *sort_args()))


@bp.get("/runs")
def runs_page():
    """The overview table; each row links to its run's dashboard page."""
    sort, order = sort_args()
    return render_template(
        "runs.html",
        overview=overview(_state().registry, _state().policy, sort, order),
        sort=sort,
        order=order,
        numeric=NUMERIC_KEYS,
        columns=COLUMNS,
        token=request.args.get("token") or "",
    )
