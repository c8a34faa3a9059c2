"""The runs overview: every run under the log root in one sortable table (``/runs``, ``/api/overview``).

Status and progress come from the same cheap per-run summary as /api/runs; the best metric is the
run's best evaluation by its task's official metric (``trainer.aggregate.best_evaluation``, as the
``aggregate`` verb picks it); the sweep a run belongs to comes from the ``sweep.json`` files under
the root (trainer/sweep writes them). The page and the API call the same ``overview`` function.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flask import Blueprint, current_app, jsonify, render_template, request

from trainer import runlog

from . import data
from .columns import finite
from .errors import choice_arg
from .reader import tail_records
from .rundata import read_json_under
from .runs import RunRegistry, StallPolicy

bp = Blueprint("overview", __name__)

SWEEP_JSON = "sweep.json"
EVAL_TAIL_BYTES = 4 << 20  # evaluation logs are short; this holds thousands of evaluations
SORT_KEYS = ("name", "sweep", "status", "progress", "best", "step", "started_at", "last_activity")
NUMERIC_KEYS = ("progress", "best", "step", "started_at", "last_activity")
COLUMNS = (
    ("name", "run"),
    ("sweep", "sweep"),
    ("status", "status"),
    ("progress", "progress"),
    ("best", "best metric"),
    ("step", "step"),
    ("started_at", "started"),
    ("last_activity", "last activity"),
)


def sweep_index(root: Path) -> tuple[dict[str, str], list[dict]]:
    """(run folder's real path -> sweep name, one summary per sweep) from sweep.json files."""
    membership: dict[str, str] = {}
    sweeps = []
    for path in [root / SWEEP_JSON, *root.glob(f"*/{SWEEP_JSON}"), *root.glob(f"*/*/{SWEEP_JSON}")]:
        summary = read_json_under(path, root)
        jobs = summary.get("jobs")
        if not isinstance(jobs, list):
            continue
        name = str(summary.get("sweep") or path.parent.name)
        for job in jobs:
            if isinstance(job, dict) and isinstance(job.get("output_dir"), str):
                membership[os.path.realpath(job["output_dir"])] = name
        counts = summary.get("counts") if isinstance(summary.get("counts"), dict) else {}
        sweeps.append(
            {
                "sweep": name,
                "folder": str(path.parent.relative_to(root)) if path.parent != root else ".",
                "status": summary.get("status"),
                "jobs": len(jobs),
                "counts": {k: v for k, v in counts.items() if isinstance(v, int)},
                "updated_at": finite(summary.get("updated_at")),
            }
        )
    return membership, sweeps


def best_of(path: Path, root: Path) -> dict | None:
    # Imported here: trainer.aggregate (and the task table it reads) is standard library only, yet
    # the other pages keep their promise of importing nothing from trainer but runlog.
    from trainer.aggregate import best_evaluation

    records = tail_records(path / runlog.LOGS_DIR / runlog.EVAL_LOG, root, EVAL_TAIL_BYTES)
    best = best_evaluation(records)
    if best is None:
        return None
    return {k: best[k] for k in ("metric", "value", "step", "task", "greater_is_better")}


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
    """Every run: status, progress, best metric, sweep; plus each sweep's counts."""
    now = time.time() if now is None else now
    root = registry.root
    membership, sweeps = sweep_index(root)
    rows = []
    for name, path in registry.runs().items():
        summary = data.run_summary(name, path, root, policy, now)
        summary["best"] = best_of(path, root)
        summary["sweep"] = membership.get(os.path.realpath(path))
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
