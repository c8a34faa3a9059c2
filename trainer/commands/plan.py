"""``plan``: dry-run candidate micro-batch / sequence-length shapes and pick the fastest that fits.

Writes ``<output_dir>/plan.json`` (every candidate) and ``<output_dir>/config.yaml`` with the choice,
so ``./launch_training.sh --config <output_dir>/config.yaml`` trains with it; ``train --auto-plan`` does both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.commands import add_config_arguments, load_config_from_args


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


def register(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="pick micro-batch and sequence length by dry runs")
    add_config_arguments(parser)
    add_plan_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    cfg = load_config_from_args(args)
    chosen_cfg = plan_and_record(cfg, args)
    if chosen_cfg is None:
        return 1
    out = Path(cfg.paths.output_dir)
    print(f"train with: ./launch_training.sh --config {out / 'config.yaml'}")
    return 0


def plan_and_record(cfg, args):
    """Run the planner, print the table, write plan.json and the chosen config; None when nothing fits."""
    from trainer.config import ConfigError, dump_config
    from trainer.planner import apply_plan, plan

    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [cfg.data.max_length]
    except ValueError:
        raise ConfigError(f"--lengths: expected comma-separated integers, got {args.lengths!r}") from None
    if any(length < 8 for length in lengths):
        raise ConfigError("--lengths: expected lengths >= 8")
    chosen, candidates, limit = plan(
        cfg, lengths, args.plan_steps, args.margin, args.memory_limit_mb, faults=args.faults
    )
    print(
        f"{'micro':>6}{'accum':>7}{'length':>8}{'tokens/s':>12}{'peak MB':>10}  status (limit {limit:,.0f} MB)"
    )
    for c in candidates:
        mark = "  <- chosen" if c is chosen else ""
        tps = f"{c.tokens_per_sec:,.0f}" if c.tokens_per_sec else "-"
        peak = f"{c.peak_mb:,.0f}" if c.peak_mb else "-"
        print(f"{c.micro:>6}{c.accum:>7}{c.max_length:>8}{tps:>12}{peak:>10}  {c.status}{mark}")
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "limit_mb": limit,
        "chosen": chosen.as_dict() if chosen else None,
        "candidates": [c.as_dict() for c in candidates],
    }
    (out / "plan.json").write_text(json.dumps(record, indent=2) + "\n")
    if chosen is None:
        print(
            "error: no candidate fits in memory; lower data.max_length or use gradient checkpointing",
            file=sys.stderr,
        )
        return None
    new_cfg = apply_plan(cfg, chosen)
    dump_config(new_cfg, out / "config.yaml")
    return new_cfg
