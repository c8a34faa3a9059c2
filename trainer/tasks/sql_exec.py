"""Execution accuracy: run predicted and gold SQL on the SQLite database and compare the answers.

A prediction is untrusted text. Databases open read-only (``mode=ro``), an authorizer allows
only reading, and a progress handler aborts any statement that runs past its time limit (a
recursive CTE that never ends), and an answer of more than ``max_rows`` rows or ``max_values``
cells is cut off, so a bad prediction scores 0 and never stalls or exhausts the evaluation.
Answers compare as multisets of rows (lists when the gold query orders them), allowing the
columns in another order, as the Spider test-suite evaluation does.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
_PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks


@dataclass(frozen=True)
class ExecResult:
    """Rows of one query, or why there are none (``timeout``, ``too_many_rows``, ``error: ...``)."""

    rows: list[tuple] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class SqliteRunner:
    """Runs queries on ``<db_root>/<db_id>/<db_id>.sqlite`` (Spider's layout), one connection per database."""

    def __init__(
        self,
        db_root: str | Path,
        timeout_s: float = 5.0,
        max_rows: int = 100_000,
        max_values: int = 1_000_000,
    ):
        self.db_root = Path(db_root)
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.max_values = max_values  # rows x columns: a wide cross join is cut off before it fills memory
        self._connections: dict[str, sqlite3.Connection] = {}
        self._deadline = 0.0

    def db_path(self, db_id: str) -> Path:
        return self.db_root / db_id / f"{db_id}.sqlite"

    def _connect(self, db_id: str) -> sqlite3.Connection:
        if db_id not in self._connections:
            path = self.db_path(db_id)
            if not path.is_file():
                raise FileNotFoundError(
                    f"no database {path} (expected <database dir>/<db_id>/<db_id>.sqlite)"
                )
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
            conn.set_authorizer(
                lambda action, *_: sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY
            )
            conn.set_progress_handler(lambda: int(time.monotonic() > self._deadline), _PROGRESS_EVERY)
            # Some Spider databases hold latin-1 bytes in TEXT columns; sqlite3 would raise on them.
            conn.text_factory = lambda raw: raw.decode("utf-8", errors="replace")
            self._connections[db_id] = conn
        return self._connections[db_id]

    def run(self, db_id: str, sql: str) -> ExecResult:
        """Execute one statement; every failure is a result, never an exception (except a missing database)."""
        conn = self._connect(db_id)
        self._deadline = time.monotonic() + self.timeout_s
        try:
            cursor = conn.execute(sql)
            width = max(1, len(cursor.description or ()))
            limit = min(self.max_rows, self.max_values // width)
            rows = cursor.fetchmany(limit + 1)
        except sqlite3.OperationalError as exc:
            if "interrupted" in str(exc):
                return ExecResult(None, "timeout")
            return ExecResult(None, f"error: {exc}")
        except (sqlite3.Error, ValueError, OverflowError) as exc:  # includes 'one statement at a time'
            return ExecResult(None, f"error: {exc}")
        finally:
            self._deadline = 0.0  # nothing runs between calls; keep the handler harmless
        if len(rows) > limit:
            return ExecResult(None, "too_many_rows")
        return ExecResult([tuple(r) for r in rows])

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()

    def __enter__(self) -> SqliteRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
