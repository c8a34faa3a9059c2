"""``prepare-corpus``: PDF, DOCX, Markdown and text files into JSONL ``text`` records, with a summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare-corpus", help="turn a folder of PDF/DOCX/Markdown/text files into a JSONL training file"
    )
    parser.add_argument("source", metavar="DIR", help="folder to read (recursively)")
    parser.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write, e.g. data.jsonl")
    parser.add_argument(
        "--priority-dir",
        default="priority",
        metavar="DIR",
        help="files here (relative to DIR, or absolute) are repeated or weighted (default: DIR/priority)",
    )
    parser.add_argument(
        "--priority-repeat",
        type=int,
        default=3,
        metavar="N",
        help="write priority records N times (default 3)",
    )
    parser.add_argument(
        "--priority-weight",
        type=float,
        metavar="W",
        help="instead of repeating, write priority records once with a 'weight' field W (others get 1.0)",
    )
    parser.add_argument(
        "--min-chars",
        type=int,
        default=50,
        metavar="N",
        help="drop records shorter than N characters (default 50)",
    )
    parser.add_argument(
        "--max-chars",
        type=int,
        default=8000,
        metavar="N",
        help="split documents into records of at most N characters at paragraph ends (0: one per file)",
    )
    parser.add_argument("--no-dedup", action="store_true", help="keep duplicate records")
    parser.add_argument("--seed", type=int, default=0, help="seed for the record order (default 0)")
    parser.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="count tokens with this tokenizer")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.data.corpus import CorpusError, Options, build_corpus, format_summary

    options = Options(
        priority_dir=Path(args.priority_dir) if args.priority_dir else None,
        priority_repeat=args.priority_repeat,
        priority_weight=args.priority_weight,
        min_chars=args.min_chars,
        max_chars=args.max_chars,
        dedup=not args.no_dedup,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    try:
        summary = build_corpus(Path(args.source).expanduser(), Path(args.out).expanduser(), options)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(summary.as_dict(), indent=2) if args.json else format_summary(summary))
    if summary.records == 0:
        print("error: no records written (see the summary above)", file=sys.stderr)
        return 1
    return 0
