"""``plan``: dry-run candidate micro-batch / sequence-length shapes and pick the fastest that fits.

Writes ``<output_dir>/plan.json`` (every candidate) and ``<output_dir>/planned_config.yaml`` (the
config with the choice), so ``./launch_training.sh --config <output_dir>/planned_config.yaml`` trains
with it; ``train --auto-plan`` plans and trains in one go. A plan is for a new run: it never writes
into a run's own files (``config.yaml`` is the record of what a run used) and refuses, with exit
code 3, a folder that already holds checkpoints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.commands import add_config_arguments, load_config_from_args
from trainer.runfolder.layout import PLAN_JSON, PLANNED_CONFIG


def add_plan_arguments(parser) -> None:
    parser.add_argument(
        "--lengths", default=None, help="comma-separated sequence lengths to try (default: data.max_length)"
    )
    parser.add_argument(
        "--plan-steps", type=int, default=2, help="measured steps per candidate (after one warm-up)"
    )
    parser.add_argument("--margin", type=float, default=0.1, help="keep this fraction of device memory free")
    parser.add_argument(
        "--memory-limit-mb", type=float, default=None, help="plan for this much memory instead"
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="training.distributed fsdp: predict each GPU's peak for this many (default: the processes "
        "this runs in, else the visible GPUs)",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="pick micro-batch and sequence length by dry runs (for a new run folder)",
        description="Writes plan.json and planned_config.yaml into paths.output_dir; refuses (exit 3) "
        "a folder that already holds checkpoints.",
    )
    add_config_arguments(parser)
    add_plan_arguments(parser)
    parser.set_defaults(func=run)


def free_sibling(out: Path) -> Path:
    """``<out>-plan``, or ``-plan-2``, ``-plan-3``...: the first name no folder has yet."""
    candidate, n = out.with_name(f"{out.name}-plan"), 2
    while candidate.exists():
        candidate, n = out.with_name(f"{out.name}-plan-{n}"), n + 1
    return candidate


def refusal(out: Path, verb: str) -> str | None:
    """One line when ``out`` holds checkpoints (a run a new shape would corrupt), else None."""
    from trainer.runfolder.checkpoints import list_checkpoints

    checkpoints = list_checkpoints(out)
    if not checkpoints:
        return None
    return (
        f"{verb}: {out} already holds a run ({checkpoints[-1].path.name}); a plan is for a new run and "
        f"changes nothing there. Plan into a new folder: --set paths.output_dir={free_sibling(out)}"
    )


def run(args) -> int:
    from trainer.cli import EXIT_RUN_EXISTS
    from trainer.config import dump_config

    cfg = load_config_from_args(args)
    out = Path(cfg.paths.output_dir)
    refused = refusal(out, "plan")
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_RUN_EXISTS
    chosen_cfg = plan_and_record(cfg, args)
    if chosen_cfg is None:
        return 1
    dump_config(chosen_cfg, out / PLANNED_CONFIG)
    print(f"plan: {out / PLAN_JSON}; config with the choice: {out / PLANNED_CONFIG}")
    print(f"train with: ./launch_training.sh --config {out / PLANNED_CONFIG}")
    return 0


def recorded_plan(cfg):
    """The config with the choice already recorded in ``<output_dir>/plan.json``, else None."""
    from trainer.tools.planner import Candidate, apply_plan

    try:
        chosen = json.loads((Path(cfg.paths.output_dir) / PLAN_JSON).read_text()).get("chosen")
        return apply_plan(cfg, Candidate(**chosen)) if chosen else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def fsdp_gpus(args) -> int:
    """--gpus, else the processes this runs in (accelerate launch), else the visible GPUs, at least 1."""
    import os

    if getattr(args, "gpus", None):
        return args.gpus
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["WORLD_SIZE"])
    import torch

    return max(1, torch.cuda.device_count())


def plan_and_record(cfg, args):
    """Run the planner, print the table, write plan.json; the chosen config, or None when nothing fits."""
    from trainer.config import ConfigError
    from trainer.tools.planner import apply_plan, plan

    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [cfg.data.max_length]
    except ValueError:
        raise ConfigError(f"--lengths: expected comma-separated integers, got {args.lengths!r}") from None
    if any(length < 8 for length in lengths):
        raise ConfigError("--lengths: expected lengths >= 8")
    gpus = fsdp_gpus(args)
    chosen, candidates, limit = plan(
        cfg, lengths, args.plan_steps, args.margin, args.memory_limit_mb, faults=args.faults, fsdp_gpus=gpus
    )
    sharded = cfg.training.distributed == "fsdp" and gpus > 1
    per_gpu = f"{f'GPU MB x{gpus}':>12}" if sharded else ""
    print(
        f"{'micro':>6}{'accum':>7}{'length':>8}{'tokens/s':>12}{'peak MB':>10}{per_gpu}  "
        f"status (limit {limit:,.0f} MB)"
    )
    for c in candidates:
        mark = "  <- chosen" if c is chosen else ""
        tps = f"{c.tokens_per_sec:,.0f}" if c.tokens_per_sec else "-"
        peak = f"{c.peak_mb:,.0f}" if c.peak_mb else "-"
        each = (f"{c.per_gpu_mb:>12,.0f}" if c.per_gpu_mb else f"{'-':>12}") if sharded else ""
        print(f"{c.micro:>6}{c.accum:>7}{c.max_length:>8}{tps:>12}{peak:>10}{each}  {c.status}{mark}")
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "limit_mb": limit,
        "chosen": chosen.as_dict() if chosen else None,
        "candidates": [c.as_dict() for c in candidates],
    }
    (out / PLAN_JSON).write_text(json.dumps(record, indent=2) + "\n")
    if chosen is None:
        print(
            "error: no candidate fits in memory; lower data.max_length or use gradient checkpointing",
            file=sys.stderr,
        )
        return None
    return apply_plan(cfg, chosen)
