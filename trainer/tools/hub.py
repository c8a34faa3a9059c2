"""Getting a model repository from the Hub (or a mirror) onto disk, and checking what arrived.

``huggingface_hub`` does the transfer: it resumes partial files, and reads ``HF_ENDPOINT``,
``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and the token (``HF_TOKEN``, or the file written
by ``hf auth login``) itself. This module adds what it doesn't: a free-space check against the
repository's size before the first byte, and a verification afterwards that names a missing or
truncated file.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "config.json"
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Any one of these makes a usable tokenizer (fast, sentencepiece, BPE or WordPiece vocabularies).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "merges.txt")


class HubError(RuntimeError):
    """A download that cannot start or finish, phrased for the user in one line."""


@dataclass
class Plan:
    """What the Hub says the repository holds at one commit, and how much of it is not on disk yet."""

    repo_id: str
    commit: str
    sizes: dict[str, int]
    missing_bytes: int
    target: Path


@dataclass
class Verification:
    folder: Path
    problems: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # files present but truncated or corrupt
    found: list[str] = field(default_factory=list)
    footprint: int = 0
    free: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def parse_size(text: str) -> int:
    """``500MB``, ``2GB``, ``1.5GiB`` or a plain number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value < 0:
        raise ValueError(f"expected a size such as 500MB or 2GB, got {text!r}")
    return int(value * units[unit])


def free_space(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would, once its folders are created)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


def cache_folder() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _already_there(repo_id: str, commit: str, path: str, size: int, local_dir: Path | None) -> bool:
    if local_dir is not None:
        target = local_dir / path
        return target.is_file() and target.stat().st_size == size
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, path, revision=commit)
    return isinstance(cached, str) and os.path.getsize(cached) == size


def plan_download(repo_id: str, revision: str | None, local_dir: Path | None) -> Plan:
    """Ask the Hub for the commit and the file sizes; count the bytes that still have to come."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    info = api.model_info(repo_id, revision=revision or "main")
    if not info.sha:
        raise HubError(f"{endpoint()} gave no commit for {repo_id}@{revision or 'main'}")
    sizes = {
        item.path: int(item.size)
        for item in api.list_repo_tree(repo_id, revision=info.sha, recursive=True)
        if isinstance(item, RepoFile)
    }
    missing = sum(
        size for path, size in sizes.items() if not _already_there(repo_id, info.sha, path, size, local_dir)
    )
    return Plan(repo_id, info.sha, sizes, missing, local_dir or cache_folder())


def check_space(plan: Plan, keep_free: int = 0) -> int:
    """Refuse before downloading when the repository would not fit; return the free bytes."""
    free = free_space(plan.target)
    if plan.missing_bytes + keep_free > free:
        extra = f" plus --keep-free {human_bytes(keep_free)}" if keep_free else ""
        raise HubError(
            f"not enough disk space: {plan.repo_id} needs {human_bytes(plan.missing_bytes)}{extra}, "
            f"but {plan.target} has {human_bytes(free)} free (free some space or pick another disk with --to)"
        )
    return free


def download(repo_id: str, revision: str | None, local_dir: Path | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(repo_id, revision=revision, local_dir=str(local_dir) if local_dir else None)
    )


def describe_hub_error(exc: BaseException, repo_id: str, revision: str | None) -> str | None:
    """One line for the errors a user can fix; None for anything else."""
    from huggingface_hub import errors

    where = endpoint()
    if isinstance(exc, errors.GatedRepoError):
        return (
            f"{repo_id} is gated: accept its terms on {where}/{repo_id}, then set HF_TOKEN "
            "(or run `hf auth login`)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"revision not found: {repo_id}@{revision} on {where}"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (
            f"repository not found on {where}: {repo_id} (check the name; private repos need HF_TOKEN "
            "or `hf auth login`)"
        )
    if isinstance(exc, errors.LocalEntryNotFoundError):
        return (
            f"{repo_id} is not in the local cache ({cache_folder()}) and the Hub cannot be reached "
            "(HF_HUB_OFFLINE set, or no network)"
        )
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file states its own length in its header: compare it with the bytes on disk."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if size < 8 or header_len <= 0 or 8 + header_len > size:
                return f"truncated: {path.name} ({size} bytes, its header does not fit)"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as exc:
        return f"unreadable: {path.name} ({exc})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and "data_offsets" in v]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"truncated: {path.name} ({size} of {expected} bytes)"
    return None


def _weights_problems(folder: Path, found: list[str], damaged: list[str]) -> list[str]:
    problems = []
    shards: list[str] = []
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
            except ValueError:
                problems.append(f"unreadable: {index} (not valid JSON)")
                continue
            names = sorted(set(weight_map.values()))
            missing = [name for name in names if not (folder / name).is_file()]
            problems += [f"weight shard missing: {name} (named in {index})" for name in missing]
            shards += [name for name in names if name not in missing]
            found.append(f"{len(names)} weight shard(s) from {index}")
    for single in SINGLE_WEIGHTS:
        if (folder / single).is_file():
            shards.append(single)
            found.append(single)
    if not shards and not problems:
        problems.append(
            f"no weights: expected {', '.join(SINGLE_WEIGHTS)} or {', '.join(WEIGHT_INDEXES)} in {folder}"
        )
    for name in shards:
        path = folder / name
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(path)
        elif name.endswith(".bin") and not zipfile.is_zipfile(path):
            problem = f"truncated or corrupt: {name} (not a complete torch zip archive)"
        else:
            problem = None
        if problem:
            problems.append(problem)
            damaged.append(name)
    return problems


def _tokenizer_problems(folder: Path, found: list[str], damaged: list[str]) -> list[str]:
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not present:
        return [f"no tokenizer: expected one of {', '.join(TOKENIZER_FILES)}"]
    problems = []
    for name in (*present, *TOKENIZER_EXTRAS):
        if name.endswith(".json") and (folder / name).is_file():
            try:
                json.loads((folder / name).read_text(encoding="utf-8"))
            except ValueError:
                problems.append(f"truncated or corrupt: {name} (not valid JSON)")
                damaged.append(name)
    found.append("tokenizer (" + ", ".join(present) + ")")
    return problems


def folder_footprint(folder: Path) -> int:
    """Bytes the model takes (cache snapshots are symlinks to blobs: count the blobs)."""
    total = 0
    for path in folder.rglob("*"):
        if ".cache" in path.relative_to(folder).parts:
            continue
        if path.is_file():
            total += path.stat().st_size
    return total


def verify(folder: Path, expected_sizes: dict[str, int] | None = None) -> Verification:
    """Check the files a training run needs: config, every weight shard (complete), tokenizer; and,
    when the Hub's listing is known, that every file it lists is here at its full size."""
    result = Verification(folder)
    config = folder / CONFIG_FILE
    if not config.is_file():
        result.problems.append(f"missing: {CONFIG_FILE}")
    else:
        try:
            json.loads(config.read_text(encoding="utf-8"))
            result.found.append(CONFIG_FILE)
        except ValueError:
            result.problems.append(f"truncated or corrupt: {CONFIG_FILE} (not valid JSON)")
            result.damaged.append(CONFIG_FILE)
    result.problems += _weights_problems(folder, result.found, result.damaged)
    result.problems += _tokenizer_problems(folder, result.found, result.damaged)
    for name, size in sorted((expected_sizes or {}).items()):
        path = folder / name
        if not path.is_file():
            if not any(name in problem for problem in result.problems):
                result.problems.append(f"missing: {name} (listed by the Hub, {size} bytes)")
        elif path.stat().st_size != size and name not in result.damaged:
            result.problems.append(f"truncated: {name} ({path.stat().st_size} of {size} bytes)")
            result.damaged.append(name)
    result.footprint = folder_footprint(folder)
    result.free = free_space(folder)
    return result


def remove_damaged(folder: Path, names: list[str]) -> None:
    """Delete damaged files so the next download fetches them again: huggingface_hub trusts a file
    whose download metadata (local folder) or cache entry exists, whatever its size."""
    for name in names:
        path = folder / name
        if path.is_symlink():
            path.resolve().unlink(missing_ok=True)  # the cache blob behind the snapshot link
        path.unlink(missing_ok=True)
        (folder / ".cache" / "huggingface" / "download" / f"{name}.metadata").unlink(missing_ok=True)
