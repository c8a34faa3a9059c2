"""``preprocess --analyze-only``: token-length distribution and truncation/splitting costs, written as
``<output_dir>/data_report.json`` and ``data_report.md`` (see trainer/data/length_report.py)."""

from __future__ import annotations

import sys

from trainer.commands import add_config_arguments, load_config_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess", help="analyze the training data: token lengths and what truncation or splitting costs"
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--analyze-only",
        "--analyze_only",
        action="store_true",
        help="write data_report.json/.md into the output folder (the only mode so far)",
    )
    parser.add_argument(
        "--max-records",
        "--max_records",
        type=int,
        default=None,
        metavar="N",
        help="analyze an evenly spaced sample of N records (default: all)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT

    if not args.analyze_only:
        print(
            "preprocess: pass --analyze-only (writing tokenized caches is not supported yet)", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    if args.max_records is not None and args.max_records < 1:
        print(f"--max-records: expected >= 1, got {args.max_records}", file=sys.stderr)
        return EXIT_BAD_INPUT
    config = load_config_from_args(args)
    from trainer.data.dataset import DataError
    from trainer.data.length_report import analyze, summary_line, write_data_report
    from trainer.families import ModelLoadError
    from trainer.model.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(config)
        report = analyze(config, tokenizer, max_records=args.max_records)
    except (DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    json_path, md_path = write_data_report(report, config.paths.output_dir)
    print(summary_line(report))
    print(f"wrote {json_path} and {md_path}")
    return 0
