"""Command-line verbs. Bad input (config, data, model path, checkpoint path) is one line on stderr and exit 2.

Each verb lives in its own module under ``trainer/commands/`` exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (args -> exit code). Add a verb by adding its module to VERBS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_BAD_INPUT = 2

VERBS = [
    "trainer.commands.train",
    "trainer.commands.check_config",
    "trainer.commands.evaluate",
    "trainer.commands.plan",
    "trainer.commands.info",
    "trainer.commands.preprocess",
    "trainer.commands.report",
    "trainer.commands.download",
    "trainer.commands.export",
    "trainer.commands.list_runs",
    "trainer.commands.prepare_corpus",
    "trainer.commands.sweep",
    "trainer.commands.aggregate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description="Fine-tuning kit: train and tools."
    )
    subparsers = parser.add_subparsers(dest="verb", required=True)
    for module in VERBS:
        try:
            importlib.import_module(module).register(subparsers)
        except ImportError as exc:  # one broken optional verb must not take `train` down with it
            print(f"warning: verb module {module} unavailable: {exc}", file=sys.stderr)
    return parser


def main(argv: list[str] | None = None, faults=None) -> int:
    """``faults``: a ``trainer.training.faults.Faults`` for tests that break a run on purpose
    (tests/faulty_trainer.py); the verbs that train or plan pass it on."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if faults is None:
        from trainer.training.faults import NO_FAULTS as faults
    args.faults = faults
    from trainer.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
