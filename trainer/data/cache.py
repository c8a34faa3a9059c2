"""The tokenized-data cache: one folder per fingerprint of (data contents, tokenizer, data settings).

``<root>/<fingerprint>/`` holds the packed rows (``trainer.data.rows``) and ``meta.json`` (what was built
from what, the data report, the length report). A folder is built under ``.tmp-<fingerprint>-<host>-<pid>``
and renamed into place when complete, under a file lock, so concurrent processes (the ranks of a node, the
points of a sweep, several nodes on a shared filesystem) build it once and the others wait and reuse it.
A changed file or setting changes the fingerprint: a new folder, never a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

CACHE_ENV = "FINETUNE_KIT_DATA_CACHE"
META = "meta.json"
KIND = "finetune-kit data cache"
LAYOUT_VERSION = 2  # bump when the rows a given input produces change (2: the last row's padding positions)
DIGESTS = ".digests.json"
HASH_BLOCK = 8 << 20


def cache_root(cache_dir: str | None) -> Path:
    """``data.cache_dir``, else $FINETUNE_KIT_DATA_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/finetune-kit/data."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "finetune-kit" / "data"


def digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def file_digest(path: Path, root: Path) -> str:
    """The content hash of a file, remembered by (path, size, mtime, ctime, inode) so a second launch reads
    nothing. The ctime catches a rewrite whose mtime was set back (``touch -r``, ``cp -p`` onto the file)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    memo_path = root / DIGESTS
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            h.update(block)
    value = h.hexdigest()
    try:
        memo = json.loads(memo_path.read_text())  # another process may have added entries meanwhile
    except (OSError, ValueError):
        memo = {}
    memo[key] = value
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{DIGESTS}.{os.getpid()}"
    tmp.write_text(json.dumps(memo))
    os.replace(tmp, memo_path)
    return value


def tokenizer_digest(tokenizer) -> str:
    """What about a tokenizer changes the ids: its vocabulary and rules, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return digest(
        [
            type(tokenizer).__name__,
            hashlib.sha256(body.encode()).hexdigest(),
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            getattr(tokenizer, "chat_template", None),
            len(tokenizer),
        ]
    )


def temporary_folder(root: Path, key: str) -> Path:
    return root / f".tmp-{key}-{socket.gethostname()}-{os.getpid()}"


def remove_stale_temporaries(root: Path, key: str) -> None:
    """Folders a killed build left; called while holding the key's lock, so none is in use."""
    for folder in root.glob(f".tmp-{key}-*"):
        shutil.rmtree(folder, ignore_errors=True)


def remove_abandoned(root: Path) -> int:
    """Builds a killed process left (``.tmp-``) and deletions cut short (``.trash-``), skipping any build whose
    lock is held (it is still running); the bytes freed."""
    from filelock import FileLock, Timeout

    freed = 0
    for folder in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
        key = folder.name.split("-")[1]
        try:
            with FileLock(str(root / f"{key}.lock"), timeout=0):
                freed += folder_size(folder)
                shutil.rmtree(folder, ignore_errors=True)
        except Timeout:
            continue
    return freed


def is_complete(folder: Path) -> bool:
    try:
        return json.loads((folder / META).read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def entries(root: Path) -> list[dict]:
    """Every complete cache folder under ``root``: fingerprint, size, when built and last used, from what."""
    out = []
    if not root.is_dir():
        return out
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not is_complete(folder):
            continue
        meta = json.loads((folder / META).read_text())
        used = (folder / META).stat().st_mtime  # see touch
        out.append(
            {
                "fingerprint": folder.name,
                "folder": str(folder),
                "bytes": folder_size(folder),
                "created": meta.get("created"),
                "last_used": max(used, meta.get("created") or 0),
                "sources": meta.get("sources"),
                "tokenizer": meta.get("tokenizer"),
                "format": meta.get("report", {}).get("format"),
                "rows": [
                    meta.get("report", {}).get("train_sequences"),
                    meta.get("report", {}).get("val_sequences"),
                ],
                "max_length": meta.get("settings", {}).get("max_length"),
            }
        )
    return out


def touch(folder: Path) -> None:
    """Mark a cache as used now (``cache list`` and ``cache clear --older-than`` go by it): the mtime of its
    meta.json, which nothing else changes; the atime would not do, since reading the file (``cache list``
    does) moves it on a relatime mount, the Linux default."""
    now = time.time()
    try:
        os.utime(folder / META, (now, now))
    except OSError:
        pass


def remove(root: Path, fingerprint: str) -> int:
    """Delete one complete cache folder under its lock (never one being built); the bytes freed."""
    from filelock import FileLock

    folder = root / fingerprint
    if "/" in fingerprint or fingerprint.startswith(".") or not is_complete(folder):
        raise FileNotFoundError(f"no data cache {fingerprint!r} in {root}")
    with FileLock(str(root / f"{fingerprint}.lock"), timeout=10):
        size = folder_size(folder)
        trash = root / f".trash-{fingerprint}-{os.getpid()}"
        os.rename(folder, trash)  # gone from readers' view at once; then deleted
        shutil.rmtree(trash, ignore_errors=True)
    return size
