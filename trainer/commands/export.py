"""``export``: a checkpoint's adapter alone, or merged into its base, ready to load with transformers."""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint: the adapter, or merged into the base (--merge), with a model card",
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="checkpoint folder (checkpoint-N, final-checkpoint-N, best-adapter) or a run folder (its best adapter)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="new (or empty) folder to write")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base weights")
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="weights dtype (default auto: the base's published dtype; adapters stay as saved)",
    )
    parser.add_argument(
        "--base",
        metavar="NAME_OR_PATH",
        help="base model to merge into (default: rebuilt from the run's config.yaml as training did)",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="safetensors shard size (default 5GB)"
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the export to this Hub repository")
    parser.add_argument(
        "--private", action="store_true", help="with --push-to-hub: create the repository private"
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.tools.export import ExportError, export, push_to_hub
    from trainer.tools.hub import parse_size

    try:
        max_shard_size = parse_size(args.max_shard_size)
    except ValueError as exc:
        print(f"error: --max-shard-size: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out).expanduser()
    try:
        summary = export(
            Path(args.checkpoint).expanduser(), out, args.merge, args.dtype, args.base, max_shard_size
        )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    what = "merged model" if summary["merged"] else "adapter"
    print(f"exported {what} ({summary['dtype']}) from {summary['checkpoint']} to {summary['out']}")
    print("files: " + ", ".join(summary["files"]))
    if args.push_to_hub:
        try:
            url = push_to_hub(out, args.push_to_hub, args.private)
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except Exception as exc:  # noqa: BLE001 - the export is on disk; say why the upload failed
            print(f"error: upload to {args.push_to_hub} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(f"pushed to {url}")
    return 0
