"""``list``: recent runs under a folder, with status, model, steps, best metric, size on disk and age.

Reads run folders only through trainer.runlog (no torch import): safe to run beside a training job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from trainer import runlog


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "list", help="list recent runs: status, model, steps, best metric, size, age"
    )
    parser.add_argument(
        "--root", default="runs", metavar="RUNS", help="folder holding run folders (default: runs)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list for scripts")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="show only the N most recent runs")
    parser.set_defaults(func=run)


def find_runs(root: Path) -> list[Path]:
    """Run folders (a run.json inside) directly under root or one level down (sweeps group runs)."""
    found = {p.parent for pattern in ("*/run.json", "*/*/run.json") for p in root.glob(pattern)}
    if (root / runlog.RUN_JSON).is_file():
        found.add(root)
    return sorted(found)


def read_eval_settings(run_dir: Path) -> tuple[str, bool]:
    """The run's own best-metric settings; the defaults when its config.yaml is missing or broken."""
    import yaml

    try:
        raw = yaml.safe_load((run_dir / runlog.CONFIG_YAML).read_text()) or {}
        section = raw.get("eval") or {}
        return str(section.get("metric_for_best", "eval_loss")), bool(section.get("greater_is_better", False))
    except (OSError, yaml.YAMLError, AttributeError):
        return "eval_loss", False


def best_metric(run_dir: Path) -> dict | None:
    metric, greater = read_eval_settings(run_dir)
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


def human_age(seconds) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def table(rows: list[dict]) -> str:
    from trainer.hub import human_bytes

    header = ("RUN", "STATUS", "MODEL", "METHOD", "STEPS", "BEST", "SIZE", "UPDATED")
    lines = [header]
    for row in rows:
        steps = f"{row['step'] if row['step'] is not None else '?'}/{row['total_steps'] or '?'}"
        best = row["best"]
        best_text = f"{best['name']} {best['value']:.4g} @{best['step']}" if best else "-"
        model = row["model"] or "?"
        if len(model) > 32:
            model = "…" + model[-31:]
        lines.append(
            (
                row["name"],
                row["status"],
                model,
                row["method"] or "?",
                steps,
                best_text,
                human_bytes(row["size_bytes"]),
                human_age(row["age_seconds"]),
            )
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT

    root = Path(args.root).expanduser()
    if not root.is_dir():
        print(f"error: --root: folder not found: {root}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.limit < 0:
        print(f"error: --limit: expected >= 0, got {args.limit}", file=sys.stderr)
        return EXIT_BAD_INPUT
    now = time.time()
    rows = [describe(run_dir, root, now) for run_dir in find_runs(root)]
    rows.sort(key=lambda r: r["updated_at"] or 0, reverse=True)
    if args.limit:
        rows = rows[: args.limit]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no runs under {root} (a run folder has a run.json)")
    else:
        print(table(rows))
    return 0
