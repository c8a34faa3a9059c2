"""One module per ``python -m trainer`` verb; see trainer/cli.py."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="training_config.yaml", help="YAML config (default: training_config.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set training.max_steps=100",
    )


def load_config_from_args(args):
    from trainer.config import load_config

    return load_config(args.config, args.overrides)
