"""``sweep SWEEP.yaml``: a grid of training jobs over GPU slots; run it again to finish what is left.

Exit codes: 0 every job finished, 1 some job failed (after its retries), 2 bad input,
130/143 stopped by SIGINT/SIGTERM (running jobs saved a checkpoint; run the sweep again to resume).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a grid of training jobs over GPU slots (docs/sweeps.md); safe to re-run"
    )
    parser.add_argument("file", metavar="SWEEP.yaml", help="the sweep file: configs, datasets, grid, seeds")
    parser.add_argument(
        "--gpus",
        metavar="IDS",
        help="GPU ids, e.g. 0,1,2,3 (default: CUDA_VISIBLE_DEVICES, nvidia-smi, else cpu)",
    )
    parser.add_argument(
        "--gpu-plan",
        metavar="N[,N...]",
        help="jobs at once per GPU, e.g. 3,3,1,3; one number for all (default 1)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the jobs and their commands; start nothing"
    )
    parser.add_argument(
        "--retries", type=int, metavar="N", help="restarts of a failed job (default: the file's, else 1)"
    )
    parser.add_argument(
        "--root", metavar="DIR", help="sweep folder (default: the file's output_root, else runs/<name>)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a config value in every job (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--tune", action="append", default=[], metavar="NAME=VALUE",
        help="old environment-style tuning for every job, e.g. NUM_WORKERS=4 (docs/sweeps.md lists them)",
    )  # fmt: skip
    parser.add_argument(
        "--only", action="append", default=[], metavar="GLOB", help="run only jobs matching (repeatable)"
    )
    parser.add_argument("--plain", action="store_true", help="one line per event instead of the live table")
    parser.add_argument("--poll", type=float, default=0.5, metavar="SECONDS", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.sweep.runner import Runner, dry_run, parse_gpus
    from trainer.sweep.spec import SweepError, load_sweep

    try:
        if args.retries is not None and args.retries < 0:
            raise SweepError(f"--retries: expected >= 0, got {args.retries}")
        if not 0.01 <= args.poll <= 60:
            raise SweepError(f"--poll: expected 0.01 to 60 seconds, got {args.poll}")
        sweep = load_sweep(
            args.file, root=args.root, cli_set=args.overrides, cli_tune=args.tune, only=args.only
        )
        if args.retries is not None:
            sweep.retries = args.retries
        slots = parse_gpus(args.gpus or sweep.gpus, args.gpu_plan or sweep.gpu_plan)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.dry_run:
        return dry_run(sweep, slots)
    live = False if args.plain else None
    return Runner(sweep, slots, out=sys.stdout, live=live, poll=args.poll).run()
