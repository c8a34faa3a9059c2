"""The one JSONL reader: remembers a byte offset and parses only what was appended.

Why: training logs grow to millions of lines while the dashboard polls every few seconds, so each
read must cost what was appended since the last one, not the whole file. A half-written last line
is left for the next read; garbage lines are counted and skipped; unknown fields pass through
(docs/run-folder.md). ``iter_records``/``read_log`` are one-shot reads through the same ``LogTail``;
``tail_records`` looks only at a file's end. A ``root`` confines every open to a folder (the
dashboard's promise); ``root=None`` reads anywhere (the trainer's own tools).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from trainer.runfolder.layout import RUN_JSON
from trainer.runfolder.records import STEP

CHUNK_BYTES = 1 << 20


def inside(path: str | os.PathLike, root: str | os.PathLike | None) -> bool:
    """True when ``path`` resolves (symlinks followed) to ``root`` or somewhere below it; any path when root is None."""
    if root is None:
        return True
    real = os.path.realpath(path)
    base = os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def parse_lines(lines: list[bytes]) -> tuple[list[dict], int]:
    """Parse complete lines into dict records; returns (records, number of garbage lines).

    Tries the whole batch as one JSON array first (about twice as fast as line by line),
    and falls back to line by line when any line is not a valid record.
    """
    if not lines:
        return [], 0
    try:
        values = json.loads(b"[" + b",".join(lines) + b"]")
        if len(values) == len(lines) and all(type(v) is dict for v in values):
            return values, 0
    except (ValueError, RecursionError):
        pass
    records: list[dict] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    return records, bad


class LogTail:
    """Follows one append-only JSONL file (under ``root`` when one is given; nothing outside it is opened)."""

    def __init__(self, path: Path, root: Path | None = None):
        self.path = path
        self.root = root
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.bad_lines = 0
        self.size = 0

    def _stat(self) -> os.stat_result | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if not inside(self.path, self.root):
            return None
        return st

    def check_replaced(self) -> bool:
        """Start over (and tell the caller to drop its data) when the file shrank or was replaced."""
        st = self._stat()
        if st is None:
            replaced = self.offset > 0
            self.size = 0
        else:
            identity = (st.st_dev, st.st_ino)
            replaced = (self.identity is not None and identity != self.identity) or st.st_size < self.offset
            self.identity = identity
            self.size = st.st_size
        if replaced:
            self.offset = 0
            self.bad_lines = 0
        return replaced

    def read_new(self) -> Iterator[list[dict]]:
        """Yield batches of records appended since the last call (call ``check_replaced`` first)."""
        if self.size <= self.offset:
            return
        try:
            handle = open(self.path, "rb")
        except OSError:
            return
        with handle:
            handle.seek(self.offset)
            remaining = self.size - self.offset
            pending = b""
            while remaining > 0:
                chunk = handle.read(min(CHUNK_BYTES, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                data = pending + chunk
                end = data.rfind(b"\n")
                if end < 0:
                    pending = data
                    continue
                pending = data[end + 1 :]
                records, bad = parse_lines(data[:end].split(b"\n"))
                # Advance only past complete lines, so a half-written last line is read again.
                self.offset += end + 1
                self.bad_lines += bad
                if records:
                    yield records


def iter_records(path: str | os.PathLike, root: Path | None = None) -> Iterator[dict]:
    """Every complete record of a log, in file order; a missing file yields nothing."""
    tail = LogTail(Path(path), root)
    tail.check_replaced()
    for batch in tail.read_new():
        yield from batch


def read_log(path: str | os.PathLike, root: Path | None = None) -> tuple[list[dict], int]:
    """(every complete record, number of garbage lines); a half-written last line is not counted."""
    tail = LogTail(Path(path), root)
    tail.check_replaced()
    records = [record for batch in tail.read_new() for record in batch]
    return records, tail.bad_lines


def tail_records(path: Path, root: Path | None = None, nbytes: int = 1 << 16) -> list[dict]:
    """The complete records in the last ``nbytes`` of a log: a cheap look at a run's present.

    Used to summarize many runs at once without reading (or keeping) their whole logs.
    """
    if not inside(path, root):
        return []
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - nbytes)
            handle.seek(start)
            data = handle.read(size - start)
    except OSError:
        return []
    end = data.rfind(b"\n")
    if end < 0:
        return []
    lines = data[:end].split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first line is cut
    return parse_lines(lines)[0]


def last_per_step(records: list[dict]) -> list[dict]:
    """After a resume, replayed steps appear twice: the last record for a step wins, in step order."""
    by_step: dict[int, dict] = {}
    for record in records:
        if isinstance(record.get(STEP), int):
            by_step[record[STEP]] = record
    return [by_step[s] for s in sorted(by_step)]


def read_json_object(path: Path, root: Path | None = None, max_bytes: int | None = 1 << 20) -> dict:
    """A JSON object file (run.json, sweep.json, trainer_state.json); anything wrong gives {}.

    ``max_bytes`` bounds what one request may make the dashboard read (None: the whole file).
    """
    if not inside(path, root):
        return {}
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(-1 if max_bytes is None else max_bytes))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def read_run_json(
    output_dir: str | os.PathLike, root: Path | None = None, max_bytes: int | None = 1 << 20
) -> dict:
    return read_json_object(Path(output_dir) / RUN_JSON, root, max_bytes)
