"""The run folder contract: file names, record fields, and the only code that writes them.

Import-light on purpose (standard library only): the dashboard, the docs and the tests
point at this module, and the dashboard must never pull in torch.
Every record is one JSON object per line with ``ts`` (Unix seconds) and, where it has
one, ``step``. Non-finite floats are written as ``null`` and named in ``nonfinite``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_JSON = "run.json"
CONFIG_YAML = "config.yaml"
LOGS_DIR = "logs"
TRAINING_LOG = "training_log.jsonl"
EVAL_LOG = "eval_log.jsonl"
EXPERT_LOG = "expert_usage_log.jsonl"
EVENTS_LOG = "events.jsonl"
ERROR_LOG = "error_log.jsonl"
GPU_LOG = "gpu_log.jsonl"
LOG_FILES = (TRAINING_LOG, EVAL_LOG, EXPERT_LOG, EVENTS_LOG, ERROR_LOG, GPU_LOG)

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_PREFIX = "final-checkpoint-"
BEST_ADAPTER_DIR = "best-adapter"
TRAINER_STATE = "trainer_state.json"

STATUSES = ("running", "finished", "failed", "interrupted")

# Fields each record type always carries (others are optional); docs/run-folder.md explains them.
REQUIRED_FIELDS = {
    TRAINING_LOG: (
        "ts",
        "step",
        "total_steps",
        "epoch",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_sec",
        "steps_per_sec",
        "eta_seconds",
        "elapsed",
        "peak_mem_mb",
    ),
    EVAL_LOG: ("ts", "step", "eval_loss", "perplexity", "eval_tokens"),
    EXPERT_LOG: ("ts", "step", "start_step", "num_experts", "top_k", "layers"),
    EVENTS_LOG: ("ts", "event"),
    ERROR_LOG: ("ts", "step", "type", "message", "traceback"),
    GPU_LOG: ("ts", "host", "device"),
}

EVENTS = (
    "run_start",
    "resume",
    "checkpoint_saved",
    "checkpoint_pruned",
    "best_updated",
    "eval_start",
    "eval_done",
    "eval_skipped",
    "step_skipped",
    "data_report",
    "model_report",
    "length_report",
    "oom_fallback",
    "signal",
    "run_end",
)


def clean_value(value: Any, path: str, nonfinite: list[str]) -> Any:
    """Replace NaN/inf (at any depth) by None and remember where, so any JSON parser reads the line."""
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(path)
        return None
    if isinstance(value, dict):
        return {k: clean_value(v, f"{path}.{k}" if path else k, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_value(v, f"{path}[{i}]", nonfinite) for i, v in enumerate(value)]
    return value


def encode_record(record: dict) -> str:
    """One newline-terminated JSON line; non-finite numbers become null plus a ``nonfinite`` list."""
    nonfinite: list[str] = []
    cleaned = clean_value(record, "", nonfinite)
    if nonfinite:
        cleaned["nonfinite"] = nonfinite
    return json.dumps(cleaned, separators=(",", ":"), allow_nan=False) + "\n"


def iter_records(path: str | os.PathLike) -> Iterator[dict]:
    """Tolerant reader: skips garbage lines and a half-written last line; missing file yields nothing."""
    try:
        with open(path, "rb") as handle:
            for raw in handle:
                if not raw.endswith(b"\n"):
                    return
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record
    except FileNotFoundError:
        return


def last_per_step(records: list[dict]) -> list[dict]:
    """After a resume, replayed steps appear twice: the last record for a step wins."""
    by_step: dict[int, dict] = {}
    for record in records:
        if isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def write_json_atomic(path: Path, payload: dict) -> None:
    """Readers never see a half-written run.json: write beside it, then rename over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(clean_value(payload, "", []), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


class RunLog:
    """Appends records to a run folder's logs; a disabled instance (ranks other than 0) writes nothing."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True):
        self.output_dir = Path(output_dir)
        self.logs_dir = self.output_dir / LOGS_DIR
        self.enabled = enabled
        self._handles: dict[str, Any] = {}
        if enabled:
            self.logs_dir.mkdir(parents=True, exist_ok=True)

    def write(self, log_name: str, record: dict) -> None:
        """Append one record and flush it, so a reader (or a crash) sees whole lines only."""
        if not self.enabled:
            return
        record = {"ts": round(time.time(), 3), **record}
        handle = self._handles.get(log_name)
        if handle is None:
            handle = open(self.logs_dir / log_name, "a", encoding="utf-8")
            self._handles[log_name] = handle
        handle.write(encode_record(record))
        handle.flush()

    def event(self, event: str, step: int | None = None, **details: Any) -> None:
        self.write(EVENTS_LOG, {"event": event, "step": step, **details})

    def update_run(self, **fields: Any) -> dict:
        """Merge fields into run.json (status, end time, ...) atomically."""
        path = self.output_dir / RUN_JSON
        current = read_run_json(self.output_dir)
        current.update(fields)
        current["updated_at"] = round(time.time(), 3)
        if self.enabled:
            write_json_atomic(path, current)
        return current

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def read_run_json(output_dir: str | os.PathLike) -> dict:
    try:
        data = json.loads((Path(output_dir) / RUN_JSON).read_text())
        return data if isinstance(data, dict) else {}
    except (FileNotFoundError, ValueError):
        return {}


def checkpoint_step(name: str) -> int | None:
    """Step number of a ``checkpoint-<step>`` or ``final-checkpoint-<step>`` folder name, else None."""
    for prefix in (FINAL_PREFIX, CHECKPOINT_PREFIX):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return int(name[len(prefix) :])
    return None


RUN_SKIP_DIRS = (LOGS_DIR, BEST_ADAPTER_DIR, "__pycache__", "node_modules")


def is_run_folder(path: Path) -> bool:
    """A run folder holds run.json or logs/."""
    return (path / RUN_JSON).is_file() or (path / LOGS_DIR).is_dir()


def find_run_folders(root: Path, max_depth: int = 4, keep=None) -> dict[str, Path]:
    """Run folders under ``root`` by name (path relative to root, '/'-separated), at most ``max_depth`` down.

    The root itself may be a run: it is then the only one, named after its folder. Hidden folders,
    checkpoints and logs are not entered; a folder reached twice (symlinks) counts once; ``keep(path)``
    may refuse a folder (the dashboard refuses links that leave its root).
    """
    root = Path(root)
    if is_run_folder(root):
        return {root.name or "run": root}
    found: dict[str, Path] = {}
    seen = {os.path.realpath(root)}

    def walk(folder: Path, rel: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name in RUN_SKIP_DIRS or checkpoint_step(name) is not None:
                continue
            try:
                if not entry.is_dir():
                    continue
            except OSError:
                continue
            path = Path(entry.path)
            real = os.path.realpath(path)
            if real in seen or (keep is not None and not keep(path)):
                continue
            seen.add(real)
            child = f"{rel}/{name}" if rel else name
            if is_run_folder(path):
                found[child] = path
            elif depth < max_depth:
                walk(path, child, depth + 1)

    walk(root, "", 1)
    return found
