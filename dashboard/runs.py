"""Which runs exist under the log root, which one a request means, and whether it is alive.

Security lives here: a run name from a request is only ever looked up in the table of folders
found under the root, never joined onto a path, so ``../``, absolute paths, encoded variants and
symlinks that leave the root cannot name anything.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from trainer import runfolder
from trainer.runfolder.columns import record_ts
from trainer.runfolder.liveness import HOST, process_gone
from trainer.runfolder.reader import inside, read_json_object
from trainer.runfolder.rundata import RunData

from .errors import DashboardError


def discover(root: Path) -> dict[str, Path]:
    """Run folders under ``root`` by name (path relative to root, '/'-separated); links leaving the root are refused.

    The root itself may be a run; it is then the only one, named after its folder.
    """
    return runfolder.find_run_folders(root, keep=lambda path: inside(path, root))


def started_at(path: Path, root: Path) -> float:
    """When a run started: run.json's ``started_at``, else its folder's modification time."""
    value = read_json_object(path / runfolder.RUN_JSON, root).get("started_at")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class RunRegistry:
    """Cached discovery plus one ``RunData`` per opened run (least recently used ones dropped)."""

    def __init__(self, root: Path, ttl: float = 2.0, max_open: int = 16):
        self.root = Path(root)
        self.ttl = ttl
        self.max_open = max_open
        self._lock = threading.Lock()
        self._found: dict[str, Path] = {}
        self._started: dict[str, float] = {}
        self._found_at = -1e18
        self._open: OrderedDict[str, RunData] = OrderedDict()

    def runs(self) -> dict[str, Path]:
        """Name -> folder, newest first, re-scanned at most every ``ttl`` seconds."""
        with self._lock:
            if time.monotonic() - self._found_at > self.ttl:
                found = discover(self.root)
                started = {name: started_at(path, self.root) for name, path in found.items()}
                order = sorted(found, key=lambda name: (-started[name], name))
                self._found = {name: found[name] for name in order}
                self._started = started
                self._found_at = time.monotonic()
            return dict(self._found)

    def started(self, name: str) -> float:
        return self._started.get(name, 0.0)

    def latest_name(self) -> str:
        runs = self.runs()
        if not runs:
            raise DashboardError(
                404, f"no runs under the log root yet (a run is a folder with {runfolder.RUN_JSON} or logs/)"
            )
        return next(iter(runs))

    def get(self, name: str | None) -> RunData:
        """The run a request names (the most recent one when ``name`` is empty), refreshed."""
        if not name:
            name = self.latest_name()
        path = self.runs().get(name)
        if path is None:
            raise DashboardError(404, f"unknown run {name!r}; see /api/runs for the runs under the log root")
        with self._lock:
            run = self._open.get(name)
            if run is None or run.path != path:
                run = self._open[name] = RunData(name, path, self.root)
            self._open.move_to_end(name)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        run.refresh()
        return run


@dataclass(frozen=True)
class StallPolicy:
    """When a run that says it is running counts as stalled (see ``assess``)."""

    factor: float = 10.0
    min_seconds: float = 60.0
    startup_seconds: float = 900.0


def typical_interval(timestamps) -> float | None:
    """Median seconds between consecutive training records (None with fewer than two)."""
    values = list(timestamps)
    gaps = [b - a for a, b in zip(values, values[1:]) if b >= a]
    return statistics.median(gaps) if gaps else None


def lifecycle(events: list[dict]) -> tuple[str | None, float | None]:
    """(status of a run_end after the last run_start, time of the last run_start)."""
    for event in reversed(events):
        kind = event.get("event")
        if kind == "run_start":
            return None, record_ts(event)
        if kind == "run_end":
            status = event.get("status")
            return (status if isinstance(status, str) else "finished"), None
    return None, None


def evaluation_under_way(events: list[dict]) -> bool:
    """True when the last evaluation event is an ``eval_start`` with no ``eval_done``/``eval_skipped`` after it."""
    for event in reversed(events):
        kind = event.get("event")
        if kind == "eval_start":
            return True
        if kind in ("eval_done", "eval_skipped", "run_start", "run_end"):
            return False
    return False


def age_words(seconds: float) -> str:
    """``82`` -> ``1 min 22 s``; ``7500`` -> ``2 h 5 min``; ``200000`` -> ``2 days 7 h``: an age a person reads."""
    seconds = max(0, math.floor(seconds + 0.5))  # halves round up, as static/app.js's duration does
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} day{'s' if days > 1 else ''}" + (f" {hours} h" if hours else "")
    if hours:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    if minutes:
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    return f"{secs} s"


ENDED = {
    "finished": "training ended normally",
    "failed": "the trainer recorded a failure",
    "interrupted": "stopped by a signal after saving a checkpoint; launch again to resume",
}


def assess(
    run_json: dict,
    events: list[dict],
    errors: list[dict],
    train_ts: list[float],
    last_activity: float | None,
    now: float,
    policy: StallPolicy,
    host: str = HOST,
) -> tuple[str, str]:
    """(status, why in plain words): running, finished, failed, interrupted, dead or stalled.

    run.json's final status wins, then a ``run_end`` event after the last ``run_start``, then an
    error logged after the last start with no training record since. A run that says it is
    running on this host whose process is gone is dead (the rule ``list`` uses,
    ``trainer.runfolder.liveness``). Otherwise it is running, unless nothing arrived for much
    longer than its usual step time: ``policy.factor`` times the median interval between training
    records, at least ``policy.min_seconds`` (``policy.startup_seconds`` before its first two
    records) - then it is stalled.
    """
    declared = run_json.get("status")
    if declared in ENDED:
        return declared, ENDED[declared]
    ended, started = lifecycle(events)
    if ended in ENDED:
        return ended, ENDED[ended]
    error_times = [t for t in map(record_ts, errors) if t is not None and (started is None or t >= started)]
    if error_times and (not train_ts or train_ts[-1] <= max(error_times)):
        return "failed", "an error was logged and no training step came after it"
    if process_gone(run_json, host):
        quiet = f"; last record {age_words(now - last_activity)} ago" if last_activity is not None else ""
        return "dead", f"its process (pid {run_json.get('pid')}) is gone from {host} without a word{quiet}"
    if last_activity is None:
        return "running", "no records yet"
    interval = typical_interval(train_ts)
    limit = max(policy.min_seconds, policy.factor * interval) if interval else policy.startup_seconds
    evaluating = evaluation_under_way(events)
    if evaluating:  # an evaluation writes no training records; give it the start-up allowance
        limit = max(limit, policy.startup_seconds)
    quiet = now - last_activity
    if quiet > limit:
        usual = f" (usually one every {age_words(interval)})" if interval and interval >= 1 else ""
        what = "new step" if train_ts else "record"
        return "stalled", f"no {what} for {age_words(quiet)}{usual}"
    if evaluating:
        return "running", "evaluating"
    return "running", "records arriving" if interval else "starting: no training steps logged yet"
