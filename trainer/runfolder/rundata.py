"""One run folder held in memory: a store per log, refreshed incrementally (the dashboard's model;
reports draw from it too).

Each store keeps its log in the cheapest shape that still answers the API: training records and
GPU samples as columns of floats, the short logs (evals, events, errors) as their records.
``RunData.refresh`` reads only the bytes appended since the last request; its lock makes a run
safe to share between server threads.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from array import array
from collections import deque
from pathlib import Path

from trainer.runfolder import layout
from trainer.runfolder.columns import Columns, StepTable, as_float, record_ts
from trainer.runfolder.reader import LogTail, read_json_object

RECENT_INTERVALS = 64
_versions = itertools.count(1)


class Store:
    """Base for per-log stores: ``version`` changes whenever the data does (plot caches use it).

    Versions come from one process-wide counter, so a store that was cleared and refilled
    never repeats a version a cache has seen.
    """

    def __init__(self) -> None:
        self.version = next(_versions)
        self.invalid = 0

    def ingest(self, records: list[dict]) -> None:
        for record in records:
            if not self.add(record):
                self.invalid += 1
        self.version = next(_versions)

    def add(self, record: dict) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        self.__init__()


class TrainLog(Store):
    """training_log.jsonl: step-keyed columns, plus the newest records in file order.

    File order matters after a resume: the trainer's current position is the last record
    written (a replayed step), not the highest step ever logged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = StepTable()
        self.latest: dict | None = None
        self.recent_ts: deque[float] = deque(maxlen=RECENT_INTERVALS)
        self.nonfinite_records = 0
        self.skipped_steps = 0

    def ingest(self, records: list[dict]) -> None:
        kept = self.table.extend(records)
        self.invalid += len(records) - len(kept)
        if kept:
            self.latest = kept[-1]
            times = [record_ts(r) for r in kept[-RECENT_INTERVALS:]]
            self.recent_ts.extend(t for t in times if t is not None)
            self.nonfinite_records += sum(1 for r in kept if r.get("nonfinite"))
            self.skipped_steps += sum(1 for r in kept if r.get("skipped") is True)
        self.version = next(_versions)


class EvalLog(Store):
    """eval_log.jsonl: the last record per (step, task) wins, as for training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[tuple[int, str], dict] = {}

    def add(self, record: dict) -> bool:
        step = record.get("step")
        if step.__class__ is not int:
            return False
        self.by_key[(step, str(record.get("task") or ""))] = record
        return True

    def records(self) -> list[dict]:
        return [self.by_key[key] for key in sorted(self.by_key)]


class ListLog(Store):
    """events.jsonl and error_log.jsonl: short, kept whole, in file order."""

    def __init__(self, required: str) -> None:
        super().__init__()
        self.required = required
        self.items: list[dict] = []

    def add(self, record: dict) -> bool:
        if not isinstance(record.get(self.required), str):
            return False
        self.items.append(record)
        return True

    def clear(self) -> None:
        self.__init__(self.required)


class GpuLog(Store):
    """gpu_log.jsonl: per ``host/device`` columns of samples, plus each device's latest sample."""

    def __init__(self) -> None:
        super().__init__()
        self.series: dict[str, Columns] = {}
        self.latest: dict[str, dict] = {}

    def ingest(self, records: list[dict]) -> None:
        """Samples grouped by device, then appended column-wise (telemetry logs grow long too)."""
        by_device: dict[str, list[dict]] = {}
        for record in records:
            device = record.get("device")
            if isinstance(device, str):
                by_device.setdefault(f"{record.get('host') or ''}/{device}".lstrip("/"), []).append(record)
            else:
                self.invalid += 1
        for key, samples in by_device.items():
            columns = self.series.get(key)
            if columns is None:
                columns = self.series[key] = Columns(ignore=("step",))
            columns.extend(samples)
            self.latest[key] = samples[-1]
        self.version = next(_versions)


class ExpertLog(Store):
    """expert_usage_log.jsonl: per window, each layer's selection counts as an array.

    The last record for a step wins (replays after a resume count once).
    """

    def __init__(self) -> None:
        super().__init__()
        self.windows: dict[int, dict] = {}

    def add(self, record: dict) -> bool:
        step = record.get("step")
        layers = record.get("layers")
        if step.__class__ is not int or not isinstance(layers, list):
            return False
        compact = []
        for position, layer in enumerate(layers):
            counts = layer.get("counts") if isinstance(layer, dict) else None
            if not isinstance(counts, list):
                return False
            index = layer.get("layer")
            compact.append(
                {
                    "layer": index if index.__class__ is int else position,
                    "name": str(layer.get("name") or ""),
                    "counts": array("d", map(_count, counts)),
                }
            )
        start = record.get("start_step")
        self.windows[step] = {
            "step": step,
            "start_step": start if start.__class__ is int else step,
            "ts": as_float(record.get("ts")),
            "num_experts": record.get("num_experts"),
            "top_k": record.get("top_k"),
            "layers": compact,
        }
        return True

    def steps(self) -> list[int]:
        return sorted(self.windows)


def _count(value) -> float:
    """An expert selection count; anything not a finite, non-negative number counts as 0."""
    number = as_float(value)
    return number if math.isfinite(number) and number > 0 else 0.0


ACTIVITY_FILES = (
    layout.TRAINING_LOG,
    layout.EVAL_LOG,
    layout.EVENTS_LOG,
    layout.ERROR_LOG,
    layout.EXPERT_LOG,
)


def files_mtime(run_dir: Path) -> float | None:
    """Newest modification time of run.json and the logs that move with training (not telemetry).

    The fallback clock for a run whose records carry no usable ``ts``.
    """
    paths = [run_dir / layout.RUN_JSON] + [run_dir / layout.LOGS_DIR / name for name in ACTIVITY_FILES]
    times = []
    for path in paths:
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            pass
    return max(times) if times else None


class RunData:
    """One run folder under the log root, read incrementally and shared between threads."""

    def __init__(self, name: str, path: Path, root: Path):
        self.name = name
        self.path = path
        self.root = root
        self.lock = threading.RLock()
        self.train = TrainLog()
        self.evals = EvalLog()
        self.events = ListLog("event")
        self.errors = ListLog("type")
        self.gpu = GpuLog()
        self.experts = ExpertLog()
        self.run_json: dict = {}
        self._run_json_stamp: tuple | None = None
        # (folder name, mtime) -> (trainer_state.json, size): checkpoints are immutable once renamed.
        self.folder_cache: dict[tuple, tuple] = {}
        logs = path / layout.LOGS_DIR
        self.stores: dict[str, Store] = {
            layout.TRAINING_LOG: self.train,
            layout.EVAL_LOG: self.evals,
            layout.EVENTS_LOG: self.events,
            layout.ERROR_LOG: self.errors,
            layout.GPU_LOG: self.gpu,
            layout.EXPERT_LOG: self.experts,
        }
        self.tails = {name: LogTail(logs / name, root) for name in self.stores}

    def refresh(self) -> None:
        """Read what was appended to every log since the last call (cheap when nothing was)."""
        with self.lock:
            self._refresh_run_json()
            for file_name, store in self.stores.items():
                tail = self.tails[file_name]
                if tail.check_replaced():
                    store.clear()
                for batch in tail.read_new():
                    store.ingest(batch)

    def _refresh_run_json(self) -> None:
        path = self.path / layout.RUN_JSON
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp != self._run_json_stamp:
            self._run_json_stamp = stamp
            self.run_json = read_json_object(path, self.root) if stamp else {}

    def versions(self) -> dict[str, int]:
        """Data version per log; the page reloads a plot only when its logs' versions change."""
        return {
            "train": self.train.version,
            "eval": self.evals.version,
            "events": self.events.version,
            "errors": self.errors.version,
            "gpu": self.gpu.version,
            "experts": self.experts.version,
            "run": hash(self._run_json_stamp) & 0xFFFFFFFF,
        }

    def bad_lines(self) -> dict[str, int]:
        """Garbage lines and unusable records per log file (counted and skipped, never fatal)."""
        return {
            name: self.tails[name].bad_lines + store.invalid
            for name, store in self.stores.items()
            if self.tails[name].bad_lines + store.invalid
        }

    def checkpoint_folders(self) -> dict[str, dict]:
        """``checkpoint-<step>`` and ``final-checkpoint-<step>`` folders on disk now, by name."""
        found: dict[str, dict] = {}
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return found
        for entry in entries:
            step = layout.checkpoint_step(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            found[entry.name] = {"name": entry.name, "step": step, "mtime": mtime, "path": Path(entry.path)}
        return found
