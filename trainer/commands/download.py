"""``download``: fetch a model repository (resumable), check free space first, verify it afterwards."""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "download",
        help="download a model from the Hub (or HF_ENDPOINT) and verify config, weight shards, tokenizer",
    )
    parser.add_argument("model_id", metavar="MODEL_ID", help="repository id, e.g. Qwen/Qwen3-0.6B")
    parser.add_argument(
        "--to", metavar="DIR", help="download into this folder (default: the Hub cache, HF_HOME/hub)"
    )
    parser.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    parser.add_argument(
        "--keep-free",
        default="0",
        metavar="SIZE",
        help="refuse unless this much stays free after the download, e.g. 10GB (default: 0)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT
    from trainer.tools import hub

    def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
        print(f"error: {message}", file=sys.stderr)
        return code

    if args.model_id.count("/") > 1 or args.model_id.startswith(("/", ".")) or not args.model_id.strip():
        return fail(f"MODEL_ID: expected a repository id such as org/name, got {args.model_id!r}")
    try:
        keep_free = hub.parse_size(args.keep_free)
    except ValueError as exc:
        return fail(f"--keep-free: {exc}")
    local_dir = Path(args.to).expanduser().resolve() if args.to else None
    if local_dir is not None and local_dir.exists() and not local_dir.is_dir():
        return fail(f"--to: {local_dir} exists and is not a folder")

    try:  # huggingface_hub 2 moved to httpx2; 1.x used httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    plan = None
    revision = args.revision
    try:
        if hub.offline():
            print("HF_HUB_OFFLINE is set: using the local cache only", file=sys.stderr)
        else:
            try:
                plan = hub.plan_download(args.model_id, revision, local_dir)
            except (httpx.ConnectError, httpx.TimeoutException) as exc:
                print(
                    f"cannot reach {hub.endpoint()} ({type(exc).__name__}); trying the local cache",
                    file=sys.stderr,
                )
        if plan is not None:
            free = hub.check_space(plan, keep_free)
            print(
                f"{args.model_id}@{plan.commit[:12]}: {len(plan.sizes)} files, "
                f"{hub.human_bytes(sum(plan.sizes.values()))} in all, "
                f"{hub.human_bytes(plan.missing_bytes)} to fetch, {hub.human_bytes(free)} free in {plan.target}",
                file=sys.stderr,
            )
            revision = plan.commit  # download exactly the commit that was sized
        folder = hub.download(args.model_id, revision, local_dir)
    except hub.HubError as exc:
        return fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub errors become one line where the user can act
        message = hub.describe_hub_error(exc, args.model_id, args.revision)
        if message is None:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return fail(f"download of {args.model_id} failed: {type(exc).__name__}: {first}", 1)
        return fail(message)

    result = hub.verify(folder, plan.sizes if plan else None)
    if result.damaged and plan is not None:
        # huggingface_hub trusts files it has already placed, whatever their size: remove and fetch again.
        print(f"re-fetching damaged file(s): {', '.join(result.damaged)}", file=sys.stderr)
        hub.remove_damaged(folder, result.damaged)
        try:
            folder = hub.download(args.model_id, revision, local_dir)
        except Exception as exc:  # noqa: BLE001
            return fail(f"re-download of {args.model_id} failed: {type(exc).__name__}: {exc}", 1)
        result = hub.verify(folder, plan.sizes)
    print(f"downloaded {args.model_id} to {folder}")
    if not result.ok:
        print(f"error: {folder} is incomplete or damaged:", file=sys.stderr)
        for problem in result.problems:
            print(f"  {problem}", file=sys.stderr)
        hint = (
            "run again with network access (HF_HUB_OFFLINE unset) to fetch or repair these files"
            if plan is None
            else "the repository itself lacks these files, or they changed during the download"
        )
        print(hint, file=sys.stderr)
        return 1
    print("verified: " + "; ".join(result.found))
    print(f"disk: {hub.human_bytes(result.footprint)} on disk, {hub.human_bytes(result.free)} free left")
    return 0
