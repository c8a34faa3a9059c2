"""Test-only entry point: ``python -m tests.faulty_trainer [--oom SPEC] [--crash-during-save NAME] <verb> ...``
runs the trainer's command line with those faults (see tests/faults.py)."""

from __future__ import annotations

import argparse
import sys

from tests.faults import InjectedFaults
from trainer.cli import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.faulty_trainer")
    parser.add_argument("--oom", default="", help='e.g. "train:1,eval:3,plan:8"')
    parser.add_argument("--crash-during-save", default=None, help="e.g. checkpoint-8")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the trainer's own arguments")
    args = parser.parse_args()
    sys.exit(main(args.argv, faults=InjectedFaults(args.oom, args.crash_during_save)))
