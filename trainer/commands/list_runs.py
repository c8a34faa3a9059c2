"""``list``: recent runs under a folder, with status, model, steps, best metric, size on disk and age.

Reads run folders through trainer.reports.runinfo (no torch import): safe to run beside a training job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


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


def human_age(seconds) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def table(rows: list[dict]) -> str:
    from trainer.tools.hub import human_bytes

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
    from trainer.reports.runinfo import describe, find_runs

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
