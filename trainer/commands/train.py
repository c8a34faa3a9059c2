"""``train``: run the loop; resumes automatically when the output folder has a checkpoint.

A finished run (its latest checkpoint is a final one, or run.json says finished) is left alone:
training it again is a no-op with a message and exit 0, never a re-save of its final checkpoint or
a second ``run_end``. ``--extend`` trains it further, to a larger ``training.max_steps``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.commands import add_config_arguments, load_config_from_args
from trainer.commands.plan import add_plan_arguments
from trainer.runfolder.layout import PLAN_JSON


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
        "--extend",
        action="store_true",
        help="train a finished run further, from its final checkpoint to a larger training.max_steps "
        "(logged as a resume; the old final checkpoint stays). Without it a finished run is left as is",
    )
    parser.add_argument(
        "--auto-plan",
        action="store_true",
        help="pick micro-batch/length by dry runs first (see plan); a run with checkpoints reuses its plan.json",
    )
    add_plan_arguments(parser)
    parser.set_defaults(func=run)


def finished_run_decision(config, extend: bool) -> tuple[int | None, str]:
    """(exit code to stop with, or None to train; the line to print) for the run in paths.output_dir."""
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.runfolder.checkpoints import finished_run

    out = Path(config.paths.output_dir)
    finished = finished_run(out)
    if finished is None:
        return None, ""
    where = finished.checkpoint.name if finished.checkpoint else "run.json"
    max_steps = config.training.max_steps
    further = max(2 * finished.step, finished.step + 1)
    if not extend:
        target = max_steps if max_steps > finished.step else further
        steps_flag = "" if max_steps > finished.step else f" --set training.max_steps={target}"
        return 0, (
            f"run {out} finished at step {finished.step} ({where}); nothing to do. To train it further "
            f"to step {target}: add --extend{steps_flag}; to start over: --set paths.output_dir=<a new folder>"
        )
    if max_steps <= finished.step:
        return EXIT_BAD_INPUT, (
            f"error: --extend: run {out} finished at step {finished.step}; expected training.max_steps above "
            f"it, got {max_steps} (e.g. --set training.max_steps={further})"
        )
    if finished.checkpoint is None:
        return EXIT_BAD_INPUT, f"error: --extend: run {out} has no final checkpoint to extend from"
    return None, (
        f"extending run {out} from step {finished.step} ({where}) to step {max_steps}: the schedule is "
        f"recomputed for {max_steps} steps, {where} stays as it is"
    )


def run(args) -> int:
    config = load_config_from_args(args)
    from trainer.cli import EXIT_BAD_INPUT, EXIT_RUN_EXISTS
    from trainer.data.dataset import DataError
    from trainer.families import ModelLoadError
    from trainer.families.extras import require_installed
    from trainer.runfolder.checkpoints import CheckpointError, list_checkpoints
    from trainer.training.loop import train

    resume = args.resume_from or ("latest" if args.resume else None)
    stop_with, message = finished_run_decision(config, args.extend)
    if message:
        print(message, file=sys.stderr if stop_with else sys.stdout, flush=True)
    if stop_with is not None:
        return stop_with
    try:  # before anything loads: transformers' "model type not recognized" says nothing about the fix
        require_installed(config)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.auto_plan:
        from trainer.commands.plan import plan_and_record, recorded_plan, refusal

        if list_checkpoints(Path(config.paths.output_dir)):
            # Re-planning a run with checkpoints would change its shape mid-run: use the plan it started with.
            planned = recorded_plan(config)
            if planned is None:
                refused = refusal(Path(config.paths.output_dir), "train --auto-plan")
                print(f"error: {refused} (or drop --auto-plan to resume it)", file=sys.stderr)
                return EXIT_RUN_EXISTS
            print(f"auto-plan: resuming with the plan in {Path(config.paths.output_dir) / PLAN_JSON}")
            config = planned
        else:
            config = plan_and_record(config, args)
            if config is None:
                return 1
    try:
        return train(config, resume=resume, config_source=args.config, faults=args.faults)
    except (CheckpointError, DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
