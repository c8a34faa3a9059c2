"""Command-line verbs. Bad input (config, data, model path, checkpoint path) is one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import os
import sys

from trainer.config import ConfigError, load_config

EXIT_BAD_INPUT = 2


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="training_config.yaml", help="YAML config (default: training_config.yaml)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set training.max_steps=100",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    train = verbs.add_parser("train", help="train (resumes automatically when the output folder has a checkpoint)")
    add_config_arguments(train)
    group = train.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="resume from the latest complete checkpoint (must exist)")
    group.add_argument("--resume_from", "--resume-from", metavar="PATH", help="resume from this checkpoint folder")
    check = verbs.add_parser("check-config", help="validate a config and print it resolved")
    add_config_arguments(check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.verb == "check-config":
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    return run_train(config, args)


def run_train(config, args) -> int:
    from trainer.checkpoints import CheckpointError
    from trainer.data import DataError
    from trainer.families import ModelLoadError
    from trainer.loop import train

    resume = args.resume_from or ("latest" if args.resume else None)
    try:
        return train(config, resume=resume, config_source=args.config)
    except (CheckpointError, DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
