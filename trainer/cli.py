"""Command-line verbs. Bad input (config, data, model path, checkpoint path) is one line on stderr and exit 2;
a plan refused for a folder that holds a run is exit 3.

Each verb lives in its own module under ``trainer/commands/`` exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (args -> exit code). Add a verb by adding its module to VERBS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_BAD_INPUT = 2
EXIT_RUN_EXISTS = 3  # plan / --auto-plan refused a folder that already holds a run's checkpoints
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `cat` exits with when its reader closes the pipe
VERBOSE_HELP = "show third-party warnings the kit hides by default (also: KIT_VERBOSE=1)"

VERBS = [
    "trainer.commands.train",
    "trainer.commands.check_config",
    "trainer.commands.needs",
    "trainer.commands.evaluate",
    "trainer.commands.plan",
    "trainer.commands.info",
    "trainer.commands.preprocess",
    "trainer.commands.cache",
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
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="verb", required=True)
    for module in VERBS:
        try:
            importlib.import_module(module).register(subparsers)
        except ImportError as exc:  # one broken optional verb must not take `train` down with it
            print(f"warning: verb module {module} unavailable: {exc}", file=sys.stderr)
    for sub in subparsers.choices.values():  # also after the verb; SUPPRESS keeps a flag given before it
        sub.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def quiet_exit_on_broken_pipe() -> int:
    """stdout's reader went away (``list --json | head``): stop like ``cat`` does, without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush would raise again
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None, faults=None) -> int:
    """``faults``: a ``trainer.training.faults.Faults`` for tests that break a run on purpose
    (tests/faulty_trainer.py); the verbs that train or plan pass it on."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if faults is None:
        from trainer.training.faults import NO_FAULTS as faults
    args.faults = faults
    from trainer import quiet

    quiet.install(args.verbose)
    from trainer.config import ConfigError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return quiet_exit_on_broken_pipe()
    except ConfigError as exc:
        for line in str(exc).splitlines():  # one problem a line, each one greppable
            print(f"config error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
