"""``train``: run the loop; resumes automatically when the output folder holds a checkpoint."""

from __future__ import annotations

import sys

from trainer.commands import add_config_arguments, load_config_from_args
from trainer.commands.plan import add_plan_arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train (resumes automatically when the output folder has a checkpoint)"
    )
    add_config_arguments(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume", action="store_true", help="resume from the latest complete checkpoint (must exist)"
    )
    group.add_argument(
        "--resume_from", "--resume-from", metavar="PATH", help="resume from this checkpoint folder"
    )
    parser.add_argument(
        "--auto-plan", action="store_true", help="pick micro-batch/length by dry runs first (see plan)"
    )
    add_plan_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    config = load_config_from_args(args)
    from trainer.checkpoints import CheckpointError
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.data import DataError
    from trainer.families import ModelLoadError
    from trainer.loop import train

    resume = args.resume_from or ("latest" if args.resume else None)
    if args.auto_plan:
        from trainer.commands.plan import plan_and_record

        config = plan_and_record(config, args)
        if config is None:
            return 1
    try:
        return train(config, resume=resume, config_source=args.config, faults=args.faults)
    except (CheckpointError, DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
