"""``needs``: the extras a config's model needs beyond ``train`` (GLA: ``gla``), as pip's extras list.

Prints them comma-separated on one line (an empty line when none); ``--missing`` keeps only those not
installed here. launch_training.sh runs it after its base set-up, installs what it prints and stops with
the pip command where that fails. Faster kernels that compile (Mamba's, on an NVIDIA GPU) are never
printed there: one line on stderr says how to get them, and training goes on without. Validates the
config like ``check-config`` (exit 2), reads only the model's config.json and imports no model code.
"""

from __future__ import annotations

import sys

from trainer.commands import add_config_arguments, load_config_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "needs", help="print the extras the config's model needs beyond train (e.g. gla), comma-separated"
    )
    add_config_arguments(parser)
    parser.add_argument("--missing", action="store_true", help="only those not installed here")
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.families import extras

    config = load_config_from_args(args)
    found = extras.missing_extras(config) if args.missing else extras.required_extras(config)
    for line in extras.advice(config):
        print(line, file=sys.stderr)
    print(",".join(extra.name for extra in found))
    return 0
