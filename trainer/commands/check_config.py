"""``check-config``: validate a config (with overrides) and print it resolved, loading no model."""

from __future__ import annotations

from trainer.commands import add_config_arguments, load_config_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser("check-config", help="validate a config and print it resolved")
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    import yaml

    config = load_config_from_args(args)
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0
