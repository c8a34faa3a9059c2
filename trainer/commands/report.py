"""``report RUN``: a static HTML page with PNG plots under ``RUN/report/``, and the loss curve in ASCII."""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write RUN/report/index.html (plots, summary) for a run folder"
    )
    parser.add_argument("run", metavar="RUN", help="a run folder (the training output_dir)")
    parser.add_argument("--no-ascii", action="store_true", help="do not print the ASCII loss curve")
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.reports.report import ReportError, ascii_loss_curve, write_report

    run_dir = Path(args.run)
    try:
        index = write_report(run_dir)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.no_ascii:
        print(ascii_loss_curve(run_dir))
    print(f"report: {index}")
    return 0
