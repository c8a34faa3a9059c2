"""Every SQL query costs at most its time limit plus a second, and at most 200 MB, whatever builtin it calls.

Some of these do all their work in one SQLite step, where no progress handler is ever called
(``printf('%.*c', 2000000000, 'x')`` took 14-32 s and about 1 GB in the evaluating process before
queries ran in a worker process). Each case is timed, and the worker's peak resident memory (VmHWM)
is watched while it runs; the evaluating process itself must not grow either.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import measured
from trainer.tasks import get_task
from trainer.tasks.sql_example import write_example_spider
from trainer.tasks.sql_exec import SqliteRunner

TIMEOUT_S = 1.0
MAX_SECONDS = TIMEOUT_S + 1.0
MAX_WORKER_MB = 200
MAX_PARENT_BYTES = 20_000_000

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")


def rows(n: int, select: str) -> str:
    return f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT {n}) SELECT {select} FROM c"


RUNAWAY = {
    "printf 2 GB": "SELECT printf('%.*c', 2000000000, 'x')",
    "zeroblob 900 MB": "SELECT zeroblob(900000000)",
    "zeroblob concatenated": "SELECT length(zeroblob(300000000) || 'x')",
    "replace amplification": "SELECT length(replace(replace(replace(printf('%.*c', 1000, 'x'), 'x', "
    "printf('%.*c', 1000, 'y')), 'y', printf('%.*c', 1000, 'z')), 'z', 'ab'))",
    "recursive CTE doubling a string": "WITH RECURSIVE c(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM c) "
    "SELECT length(s) FROM c",
    "recursive CTE without end": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    "SELECT x FROM c ORDER BY x DESC LIMIT 1",
    "instr, one step of minutes": "SELECT instr(printf('%.*c', 4000000, 'a'), printf('%.*c', 2000000, 'a') || 'b')",
    "group_concat over millions": rows(5_000_000, "group_concat(x)"),
    "an answer of 1 GB": rows(1000, "printf('%.*c', 1000000, 'x')"),
    "a sort of 1 GB": rows(1000, "printf('%.*c', 1000000, 'x') AS s") + " ORDER BY s DESC",
}


class PeakRss:
    """The largest VmHWM seen of the runner's worker (re-read every 10 ms: a killed worker takes its own with it)."""

    def __init__(self, runner: SqliteRunner):
        self.runner, self.mb, self._done = runner, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> None:
        pid = self.runner.worker_pid
        try:
            with open(f"/proc/{pid}/status") as status:
                kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
            self.mb = max(self.mb, kb / 1024)
        except (OSError, StopIteration, TypeError):
            pass  # no worker at this instant

    def _watch(self) -> None:
        while not self._done.wait(0.01):
            self._read()

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._read()  # a worker still alive: its exact high-water mark
        self._done.set()
        self._thread.join()


@pytest.fixture(scope="module")
def spider(tmp_path_factory):
    return write_example_spider(tmp_path_factory.mktemp("spider"))


# Python 3.10 has no Connection.setlimit: a string limit of 1e9 (SQLite's own) is what the worker runs with there.
@pytest.mark.parametrize(
    "max_value_bytes", [10_000_000, 1_000_000_000], ids=["length-limit", "no-length-limit"]
)
@pytest.mark.parametrize("label", list(RUNAWAY))
def test_a_runaway_query_is_bounded_in_time_and_memory(spider, label, max_value_bytes):
    with SqliteRunner(spider / "database", timeout_s=TIMEOUT_S, max_value_bytes=max_value_bytes) as runner:
        assert runner.run("concert_singer", "SELECT 1").rows == [
            (1,)
        ]  # the worker is up before the clock starts
        with PeakRss(runner) as peak:
            result, seconds, parent_peak = measured(runner.run, "concert_singer", RUNAWAY[label])
        assert not result.ok, f"{label}: {result.rows and len(result.rows)} rows"
        assert seconds < MAX_SECONDS, f"{label}: {seconds:.2f} s ({result.error})"
        assert 0 < peak.mb < MAX_WORKER_MB, f"{label}: the worker peaked at {peak.mb:.0f} MB ({result.error})"
        assert parent_peak < MAX_PARENT_BYTES, (
            f"{label}: the evaluating process grew by {parent_peak / 1e6:.0f} MB"
        )
        assert runner.run("concert_singer", "SELECT count(*) FROM singer").rows == [(6,)]  # and goes on


def test_the_printf_case_is_killed_at_its_deadline_with_the_default_limits(spider):
    """printf's padding loop runs 2e9 times inside one SQLite step even once the string limit stopped it
    growing: only killing the worker ends it, ``KILL_GRACE_S`` after the time limit."""
    with SqliteRunner(spider / "database", timeout_s=TIMEOUT_S) as runner:
        runner.run("concert_singer", "SELECT 1")
        first = runner.worker_pid
        start = time.monotonic()
        assert runner.run("concert_singer", RUNAWAY["printf 2 GB"]).error == "timeout"
        assert TIMEOUT_S <= time.monotonic() - start < MAX_SECONDS
        assert runner.worker_pid is None  # killed; the next query starts another
        assert runner.run("pets_1", "SELECT count(*) FROM pets").rows == [(4,)]
        assert runner.worker_pid not in (None, first)


def test_each_limit_reports_its_own_reason(spider):
    with SqliteRunner(spider / "database", timeout_s=TIMEOUT_S) as runner:
        assert runner.run("concert_singer", RUNAWAY["an answer of 1 GB"]).error == "too_large"
        assert (
            runner.run("concert_singer", RUNAWAY["zeroblob 900 MB"]).error == "error: string or blob too big"
        )
        assert runner.run("concert_singer", rows(200_000, "x")).error == "too_many_rows"
    # Without the answer-size cap, the worker's memory limit still ends it: out of memory, not a crash.
    with SqliteRunner(spider / "database", timeout_s=5, max_bytes=10**12, memory_mb=64) as runner:
        assert runner.run("concert_singer", RUNAWAY["an answer of 1 GB"]).error == "out_of_memory"
        assert runner.run("concert_singer", "SELECT count(*) FROM singer").rows == [(6,)]


def test_closing_the_runner_ends_its_worker(spider):
    runner = SqliteRunner(spider / "database")
    runner.run("concert_singer", "SELECT 1")
    worker = runner._worker
    runner.close()
    assert worker.poll() is not None and runner.worker_pid is None


def test_a_prediction_that_hits_a_limit_scores_zero_and_the_evaluation_goes_on(spider):
    task = get_task("spider", spider, timeout_s=TIMEOUT_S)
    gold = "SELECT name FROM singer"
    examples = [{"db_id": "concert_singer", "question": "?", "query": gold}] * 4
    predictions = [" " + RUNAWAY["printf 2 GB"], " " + RUNAWAY["zeroblob 900 MB"], " " + gold, " SELECT nope"]
    start = time.monotonic()
    result = task.score(predictions, examples)
    assert time.monotonic() - start < len(predictions) * MAX_SECONDS
    assert result["execution_accuracy"] == pytest.approx(1 / 4)
    assert result["timeouts"] + result["exec_errors"] == 3 and result["gold_errors"] == 0


def test_the_worker_needs_only_the_standard_library():
    """It runs as ``python -I -S``: no site-packages, so importing anything else would fail there."""
    source = (Path(__file__).parents[2] / "trainer" / "tasks" / "sql_worker.py").read_text()
    imported = {
        line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
