"""``sweep SWEEP.yaml``: a grid of training jobs over GPU slots; run it again to finish what is left.

``--backend slurm`` submits the grid as one SLURM job array instead (trainer/sweep/slurm.py), and
``sweep status SWEEP.yaml`` shows each job's state, SLURM id and queue state, and progress.

Exit codes: 0 every job finished (slurm: submitted), 1 some job failed (after its retries; slurm:
sbatch failed), 2 bad input, 130/143 stopped by SIGINT/SIGTERM (running jobs saved a checkpoint; run
the sweep again to resume).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a grid of training jobs over GPU slots (docs/sweeps.md); safe to re-run"
    )
    parser.add_argument(
        "file", nargs="+", metavar="SWEEP.yaml",
        help="the sweep file: configs, datasets, grid, seeds; `status SWEEP.yaml` shows how far it got",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=("local", "slurm"),
        help="local: this machine's GPUs (default); slurm: submit one job array (docs/sweeps.md)",
    )  # fmt: skip
    parser.add_argument("--partition", help="slurm: the partition (default: the file's slurm.partition)")
    parser.add_argument("--time", help="slurm: each task's time limit, e.g. 04:00:00")
    parser.add_argument(
        "--slurm", action="append", default=[], metavar="KEY=VALUE",
        help="slurm: any option of the file's slurm: section, e.g. gpus_per_job=1 (repeatable)",
    )  # fmt: skip
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


def _split_file(args) -> tuple[str | None, str]:
    """``sweep FILE`` or ``sweep status FILE``: (the sub-verb or None, the sweep file)."""
    from trainer.sweep.jobs import SweepError

    if len(args.file) == 1:
        return None, args.file[0]
    if len(args.file) == 2 and args.file[0] == "status":
        return "status", args.file[1]
    raise SweepError(f"expected SWEEP.yaml or status SWEEP.yaml, got {' '.join(args.file)}")


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.sweep import slurm
    from trainer.sweep.jobs import SweepError
    from trainer.sweep.runner import Runner, dry_run, parse_gpus
    from trainer.sweep.spec import load_sweep

    try:
        verb, args.file = _split_file(args)
        if verb == "status":
            return show_status(args)
        if args.retries is not None and args.retries < 0:
            raise SweepError(f"--retries: expected >= 0, got {args.retries}")
        if not 0.01 <= args.poll <= 60:
            raise SweepError(f"--poll: expected 0.01 to 60 seconds, got {args.poll}")
        sweep = load_sweep(
            args.file, root=args.root, cli_set=args.overrides, cli_tune=args.tune, only=args.only
        )
        if args.retries is not None:
            sweep.retries = args.retries
        if (args.backend or sweep.backend) == "slurm":
            if args.gpus or args.gpu_plan:
                raise SweepError("--gpus/--gpu-plan: SLURM picks the GPUs; ask with --slurm gpus_per_job=N")
            opts = slurm.slurm_options(sweep.slurm, _slurm_flags(args))
            return slurm.submit(sweep, opts, dry_run=args.dry_run, out=sys.stdout)
        slots = parse_gpus(args.gpus or sweep.gpus, args.gpu_plan or sweep.gpu_plan)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.dry_run:
        return dry_run(sweep, slots)
    live = False if args.plain else None
    return Runner(sweep, slots, out=sys.stdout, live=live, poll=args.poll).run()


def _slurm_flags(args) -> list[str]:
    flags = list(args.slurm)
    if args.partition:
        flags.append(f"partition={args.partition}")
    if args.time:
        flags.append(f"time={args.time}")
    return flags


def show_status(args) -> int:
    """Each job's state, SLURM id and queue state, attempt and progress; refreshes a SLURM sweep's sweep.json."""
    from trainer.sweep import slurm, status
    from trainer.sweep.spec import load_sweep

    sweep = load_sweep(args.file, root=args.root, only=args.only, validate=False)
    if status.read_sweep_json(sweep.root).get("backend") == "slurm":
        summary = slurm.refresh(sweep)
    else:  # a local sweep: what its sweep.json said last, with progress read now
        summary = status.read_sweep_json(sweep.root)
        if not summary.get("jobs"):
            raise slurm.SweepError(f"{sweep.root / status.SWEEP_JSON}: not found; start the sweep first")
        for job in summary["jobs"]:
            job["progress"] = status.progress(Path(job["output_dir"])) or job.get("progress")
    slurm.render_status(summary, sys.stdout)
    return 0
