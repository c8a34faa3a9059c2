"""``cache list`` / ``cache clear``: the tokenized data caches (trainer/data/cache.py), their sizes, and a safe
way to remove them (only complete cache folders, each under its lock, so never one being built)."""

from __future__ import annotations

import json
import sys
import time


def register(subparsers) -> None:
    parser = subparsers.add_parser("cache", help="list or clear the tokenized data caches")
    parser.add_argument("action", choices=["list", "clear"])
    parser.add_argument("fingerprints", nargs="*", help="clear: the caches to remove (see cache list)")
    parser.add_argument("--cache-dir", "--cache_dir", default=None, help="default: data.cache_dir's default")
    parser.add_argument("--all", action="store_true", help="clear: every cache")
    parser.add_argument(
        "--older-than",
        "--older_than",
        type=float,
        default=None,
        metavar="DAYS",
        help="clear: unused for DAYS",
    )
    parser.add_argument("--json", action="store_true", help="list: one JSON object per line")
    parser.set_defaults(func=run)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.data import cache

    root = cache.cache_root(args.cache_dir)
    found = cache.entries(root)
    if args.action == "list":
        for entry in found:
            if args.json:
                print(json.dumps(entry))
            else:
                age = (time.time() - entry["last_used"]) / 86400
                print(
                    f"{entry['fingerprint']}  {_size(entry['bytes']):>10}  used {age:.1f} d ago  "
                    f"{entry['format']}  {entry['rows'][0]} rows x {entry['max_length']}  {entry['sources']['train']}"
                )
        if not args.json:
            total = sum(e["bytes"] for e in found)
            print(f"{len(found)} cache(s), {_size(total)} in {root}")
        return 0
    chosen = set(args.fingerprints)
    if not chosen and not args.all and args.older_than is None:
        print("cache clear: name caches to remove, or pass --all or --older-than DAYS", file=sys.stderr)
        return EXIT_BAD_INPUT
    known = {e["fingerprint"] for e in found}
    unknown = sorted(chosen - known)
    if unknown:
        print(f"cache clear: no cache {unknown[0]!r} in {root} (see cache list)", file=sys.stderr)
        return EXIT_BAD_INPUT
    cutoff = time.time() - args.older_than * 86400 if args.older_than is not None else None
    freed = removed = 0
    for entry in found:
        wanted = (
            args.all or entry["fingerprint"] in chosen or (cutoff is not None and entry["last_used"] < cutoff)
        )
        if wanted:
            freed += cache.remove(root, entry["fingerprint"])
            removed += 1
    abandoned = cache.remove_abandoned(root) if root.is_dir() else 0
    print(f"removed {removed} cache(s), {_size(freed + abandoned)} freed from {root}")
    return 0
