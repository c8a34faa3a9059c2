"""``preprocess``: build the config's tokenized data cache ahead of training (every rank, resume and sweep
point with the same data, tokenizer and settings then reuses it), and report the token lengths: printed,
and with ``--analyze-only``/``--report`` written as ``<output_dir>/data_report.json`` and ``data_report.md``
(see trainer/data/length_report.py)."""

from __future__ import annotations

import sys

from trainer.commands import add_config_arguments, load_config_from_args


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess",
        help="tokenize and pack the training data into its cache, and report token lengths and truncation costs",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--analyze-only",
        "--analyze_only",
        "--report",
        dest="write_report",
        action="store_true",
        help="also write data_report.json/.md into paths.output_dir",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT

    config = load_config_from_args(args)
    from trainer.data.dataset import DataError, prepare_data
    from trainer.data.length_report import summary_line, write_data_report
    from trainer.data.prepare import workers_of
    from trainer.families import ModelLoadError, family_for
    from trainer.families.extras import model_type
    from trainer.model.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(config)
        packing = family_for(model_type(config) or "", config.model.family).packing
        prepared = prepare_data(config.paths, config.data, tokenizer, packing, workers_of(config.performance))
    except (DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    r = prepared.report
    print(
        f"data cache {r.fingerprint} {'reused' if r.cache_hit else 'built'} in {r.prepare_seconds:.2f} s: "
        f"{r.train_sequences:,} train / {r.val_sequences:,} val rows of {config.data.max_length} tokens "
        f"({r.train_tokens:,} train tokens, {r.format} format, {r.skipped_lines} skipped) in {r.cache}"
    )
    print(summary_line(prepared.length_report))
    if args.write_report:
        json_path, md_path = write_data_report(prepared.length_report, config.paths.output_dir)
        print(f"wrote {json_path} and {md_path}")
    return 0
