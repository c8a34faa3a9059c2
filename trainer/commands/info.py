"""``info``: GPUs, CPU, RAM, disk, versions, unavailable features and recommended starting settings."""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "info", help="describe this machine: GPUs, memory, disk, versions, features, suggested settings"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    parser.add_argument(
        "--output-dir",
        "--output_dir",
        default=None,
        help="folder whose disk space to report (default: paths.output_dir of --config)",
    )
    parser.add_argument(
        "--config", default="training_config.yaml", help="config to read paths.output_dir from, if present"
    )
    parser.set_defaults(func=run)


def output_dir_from(args) -> str:
    """``--output-dir``, else the config's paths.output_dir read leniently (info never fails on a config)."""
    if args.output_dir:
        return args.output_dir
    import yaml

    from trainer.config import PathsConfig

    try:
        raw = yaml.safe_load(Path(args.config).read_text()) or {}
        value = (raw.get("paths") or {}).get("output_dir")
        if isinstance(value, str) and value:
            return value
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    return PathsConfig().output_dir


def run(args) -> int:
    from trainer.tools.hardware import format_text, gather

    info = gather(output_dir_from(args))
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0
