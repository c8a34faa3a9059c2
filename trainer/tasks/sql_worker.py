"""The process that runs text-to-SQL queries for ``sql_exec.SqliteRunner``.

Whatever a predicted query makes SQLite do, it costs this process, never the evaluation's: the runner
kills it at the deadline (some builtins do all their work in one step, where no progress handler is
called: ``printf('%.*c', 2000000000, 'x')`` or ``instr`` over megabytes) and starts another. Limits set
here turn most runaway queries into a quick error before that:

- ``SQLITE_LIMIT_LENGTH`` (Python 3.11+): no string, blob or row over ``max_value_bytes``;
- ``PRAGMA hard_heap_limit``: SQLite's own memory (sorts, temporary tables, kept in memory rather than in
  temporary files) stays under ``heap_bytes``; a soft limit at half of it makes page caches give way first;
- ``RLIMIT_AS``: the address space grows by at most ``memory_bytes`` over what it was at start (the backstop
  for whatever the others miss, and the only memory bound left on Python 3.10, which has no ``setlimit``);
- a progress handler ends a statement that runs past its deadline (a recursive CTE that never ends);
- at most ``max_rows`` rows, ``max_values`` cells and ``max_bytes`` of text and blobs per answer.

It is run by path with the standard library only (``python -I -S sql_worker.py SETTINGS``), so it starts in
a few tens of milliseconds. Requests come on stdin and answers go to stdout, each a pickle behind an 8-byte
length: first ``"ready"``, then for each ``(db_path, sql, timeout_s, max_rows, max_values, max_bytes)``
either ``("rows", rows)`` or ``("error", reason)``. It exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sqlite3
import struct
import sys
import time

_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
_PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks
_FETCH = 64  # rows per fetch: the answer's size is checked as it grows
_HEADER = struct.Struct("<Q")


def read_message(stream):
    """The next message, or None at end of stream."""
    header = read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    body = read_exactly(stream, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def read_exactly(stream, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(stream, message) -> None:
    """Length, then pickle; every byte, on a buffered or a raw (unbuffered pipe) stream alike."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    for data in (_HEADER.pack(len(body)), body):
        view = memoryview(data)
        while view:
            view = view[stream.write(view) :]
    stream.flush()


def limit_address_space(extra: int) -> None:
    """Let the address space grow by ``extra`` bytes at most; where the OS can't say or enforce it, skip."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            now = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (now + extra, now + extra))
    except (ImportError, OSError, ValueError, AttributeError):
        pass  # no /proc or no RLIMIT_AS (macOS): SQLite's own limits and the deadline's kill remain


class Worker:
    """One connection per database, read-only; every query under the limits above."""

    def __init__(self, max_value_bytes: int):
        self.max_value_bytes = max_value_bytes
        self.connections: dict[str, sqlite3.Connection] = {}
        self.deadline = 0.0

    def connect(self, path: str) -> sqlite3.Connection:
        if path not in self.connections:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            if hasattr(conn, "setlimit"):  # Python 3.11+
                conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_value_bytes)
            conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temp tables count against the heap limit
            conn.set_authorizer(
                lambda action, *_: sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY
            )
            conn.set_progress_handler(lambda: int(time.monotonic() > self.deadline), _PROGRESS_EVERY)
            # Some Spider databases hold latin-1 bytes in TEXT columns; sqlite3 would raise on them.
            conn.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
            self.connections[path] = conn
        return self.connections[path]

    def run(self, path: str, sql: str, timeout_s: float, max_rows: int, max_values: int, max_bytes: int):
        conn = self.connect(path)
        self.deadline = time.monotonic() + timeout_s
        cursor = None
        try:
            cursor = conn.execute(sql)
            limit = min(max_rows, max_values // max(1, len(cursor.description or ())))
            rows, size = [], 0
            while chunk := cursor.fetchmany(_FETCH):
                rows.extend(chunk)
                size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for row in chunk for v in row)
                if len(rows) > limit:
                    return "error", "too_many_rows"
                if size > max_bytes:
                    return "error", "too_large"
            return "rows", rows
        except MemoryError:
            return "error", "out_of_memory"
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                return "error", "timeout"
            return "error", "out_of_memory" if "out of memory" in str(exc) else f"error: {exc}"
        except (sqlite3.Error, ValueError, OverflowError) as exc:  # includes 'one statement at a time'
            return "error", f"error: {exc}"
        finally:
            self.deadline = 0.0
            if cursor is not None:
                cursor.close()  # frees the statement's memory now, not when the cursor is collected


def main() -> None:
    settings = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; stdin closing ends us
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print can never corrupt the answers
    heap = int(settings["heap_bytes"])
    conn = sqlite3.connect(":memory:")  # process-wide settings; an older SQLite ignores unknown pragmas
    conn.execute(f"PRAGMA hard_heap_limit = {heap}")
    conn.execute(f"PRAGMA soft_heap_limit = {heap // 2}")
    conn.close()
    limit_address_space(int(settings["memory_bytes"]))
    worker = Worker(int(settings["max_value_bytes"]))
    write_message(answers, "ready")
    while (request := read_message(requests)) is not None:
        try:
            answer = worker.run(*request)
            write_message(answers, answer)
        except MemoryError:
            write_message(answers, ("error", "out_of_memory"))


if __name__ == "__main__":
    main()
