"""Execution accuracy: run predicted and gold SQL on the SQLite database and compare the answers.

A prediction is untrusted text, and one SQLite builtin can do unbounded work in a single step
(``printf('%.*c', 2000000000, 'x')`` builds 2 GB before any progress handler is called). So queries
run in a worker process (``sql_worker.py``): databases open read-only (``mode=ro``), an authorizer
allows only reading, strings and SQLite's heap are capped, the process's memory is capped, a
progress handler ends a statement at its time limit, answers are cut off past ``max_rows`` rows,
``max_values`` cells or ``max_bytes`` of text, and a query still running ``KILL_GRACE_S`` after its
limit is killed with its process. A bad prediction scores 0 and never stalls or exhausts the
evaluation. Answers compare as multisets of rows (lists when the gold query orders them), allowing
the columns in another order, as the Spider test-suite evaluation does.
"""

from __future__ import annotations

import itertools
import json
import pickle
import select
import subprocess
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trainer.tasks.sql_worker import read_exactly, write_message

WORKER = Path(__file__).with_name("sql_worker.py")
# Past the time limit, before the worker is killed (its progress handler has usually ended the query by then).
KILL_GRACE_S = 0.5
START_TIMEOUT_S = 30.0  # a worker that has not answered "ready" by then will not
_HEADER_BYTES = 8
_TIMED_OUT = object()  # what ``_receive`` returns when the deadline passed first


@dataclass(frozen=True)
class ExecResult:
    """Rows of one query, or why there are none: ``timeout``, ``too_many_rows``, ``too_large`` (over
    ``max_bytes``), ``out_of_memory`` (over the worker's memory limits) or ``error: ...``."""

    rows: list[tuple] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class SqliteRunner:
    """Runs queries on ``<db_root>/<db_id>/<db_id>.sqlite`` (Spider's layout) in one worker process.

    ``memory_mb`` bounds the worker's growth (address space), ``max_value_bytes`` any one string or
    blob, ``max_bytes`` the text and blobs of one answer; the worker starts at the first query and
    ends with ``close()``."""

    def __init__(
        self,
        db_root: str | Path,
        timeout_s: float = 5.0,
        max_rows: int = 100_000,
        max_values: int = 1_000_000,
        max_bytes: int = 16_000_000,
        max_value_bytes: int = 10_000_000,
        memory_mb: int = 160,
    ):
        self.db_root = Path(db_root)
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.max_values = max_values  # rows x columns: a wide cross join is cut off before it fills memory
        self.max_bytes = max_bytes
        # SQLite's heap gets 60% of the memory; Python's copy of the answer needs the rest.
        self.settings = {
            "max_value_bytes": max_value_bytes,
            "heap_bytes": memory_mb * 2**20 * 3 // 5,
            "memory_bytes": memory_mb * 2**20,
        }
        self._checked: set[str] = set()
        self._worker: subprocess.Popen | None = None

    def db_path(self, db_id: str) -> Path:
        return self.db_root / db_id / f"{db_id}.sqlite"

    def _path(self, db_id: str) -> str:
        path = self.db_path(db_id)
        if db_id not in self._checked:
            if not path.is_file():
                raise FileNotFoundError(
                    f"no database {path} (expected <database dir>/<db_id>/<db_id>.sqlite)"
                )
            self._checked.add(db_id)
        return str(path.resolve())

    def run(self, db_id: str, sql: str) -> ExecResult:
        """Execute one statement; every failure is a result, never an exception (except a missing database)."""
        request = (self._path(db_id), sql, self.timeout_s, self.max_rows, self.max_values, self.max_bytes)
        worker = self._start()
        try:
            write_message(worker.stdin, request)
            answer = self._receive(time.monotonic() + self.timeout_s + KILL_GRACE_S)
        except (OSError, EOFError, pickle.UnpicklingError):
            answer = None
        if answer is _TIMED_OUT:
            self._stop(kill=True)  # still inside one SQLite step: only killing the process ends it
            return ExecResult(None, "timeout")
        if answer is None:
            code = worker.poll()
            self._stop(kill=True)
            return ExecResult(None, f"error: the SQL worker process ended (exit {code}); it restarts")
        kind, value = answer
        return ExecResult(value) if kind == "rows" else ExecResult(None, value)

    @property
    def worker_pid(self) -> int | None:
        """The worker's process id while one is running (to watch its memory), else None."""
        return self._worker.pid if self._worker is not None and self._worker.poll() is None else None

    def _start(self) -> subprocess.Popen:
        if self._worker is not None and self._worker.poll() is None:
            return self._worker
        self._worker = subprocess.Popen(
            [sys.executable, "-I", "-S", str(WORKER), json.dumps(self.settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        weakref.finalize(self, _end, self._worker)
        if self._receive(time.monotonic() + START_TIMEOUT_S) != "ready":
            self._stop(kill=True)
            raise RuntimeError(f"the SQL worker ({sys.executable} {WORKER}) did not start")
        return self._worker

    def _receive(self, deadline: float):
        """The worker's next message; ``_TIMED_OUT`` if none came by ``deadline``, None if it died."""
        stream = self._worker.stdout
        if not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return _TIMED_OUT
        header = read_exactly(stream, _HEADER_BYTES)
        if header is None:
            return None
        size = int.from_bytes(header, "little")
        if size > 2 * self.max_bytes + 16 * self.max_values + 2**20:  # cannot be an answer within the limits
            return None
        body = read_exactly(stream, size)
        return None if body is None else pickle.loads(body)

    def _stop(self, kill: bool = False) -> None:
        if self._worker is not None:
            if kill:
                self._worker.kill()
            _end(self._worker)
            self._worker = None

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> SqliteRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _end(worker: subprocess.Popen) -> None:
    """Close the worker's input (it exits at once when idle) and kill it if it does not."""
    if worker.poll() is None:
        try:
            worker.stdin.close()
            worker.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            worker.kill()
            worker.wait()
    for stream in (worker.stdin, worker.stdout):
        stream.close()


def results_match(predicted: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Same rows (in the same order when ``ordered``), allowing a permutation of the columns."""
    if len(predicted) != len(gold):
        return False
    if not gold:
        return True
    width = len(gold[0])
    if any(len(r) != width for r in predicted):
        return False
    same = (lambda a, b: a == b) if ordered else (lambda a, b: Counter(a) == Counter(b))
    if same(predicted, gold):
        return True
    # Only columns holding the same multiset of values can correspond; try those pairings.
    gold_cols = [Counter(r[i] for r in gold) for i in range(width)]
    pred_cols = [Counter(r[j] for r in predicted) for j in range(width)]
    choices = [[j for j in range(width) if pred_cols[j] == gold_cols[i]] for i in range(width)]
    for perm in itertools.islice(itertools.product(*choices), 10_000):
        if len(set(perm)) == width and same([tuple(r[j] for j in perm) for r in predicted], gold):
            return True
    return False
