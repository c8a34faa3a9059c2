"""``aggregate --root RUNS --output OUT``: best evaluation of every run by its task's official metric,
mean ± std over seeds per dataset and experiment, as CSV, JSON, Markdown and a PNG (docs/sweeps.md).
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "aggregate", help="results table over runs: best checkpoint by official metric, mean ± std over seeds"
    )
    parser.add_argument(
        "--root", default="runs", metavar="RUNS", help="folder holding run folders (default: runs)"
    )
    parser.add_argument(
        "--output", required=True, metavar="OUT", help="folder for results.{csv,json,md,png} and runs.csv"
    )
    parser.add_argument(
        "--small", action="store_true", help="leave out path columns (run and checkpoint folders)"
    )
    parser.add_argument(
        "--only-finished", action="store_true", help="leave out runs whose run.json is not finished"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.reports.aggregate import aggregate, find_run_folders, markdown, write_outputs

    root = Path(args.root).expanduser()
    if not root.is_dir():
        print(f"error: --root: folder not found: {root}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not find_run_folders(root):
        print(
            f"error: --root: no run folders under {root} (a run folder has run.json or logs/)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    out = Path(args.output).expanduser()
    if out.exists() and not out.is_dir():
        print(f"error: --output: {out} is a file; expected a folder (created if missing)", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = aggregate(root, only_finished=args.only_finished)
    files = write_outputs(result, out, small=args.small)
    print(markdown(result, small=args.small))
    print(f"{len(result['runs'])} runs in {len(result['groups'])} groups, {len(result['problems'])} left out")
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
