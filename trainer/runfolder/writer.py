"""The only code that writes a run folder's logs and run.json (rank 0 of the trainer).

Records are appended and flushed one by one, so a reader (or a crash) only ever sees whole lines;
JSON files are replaced atomically, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.runfolder.layout import EVENTS_LOG, LOGS_DIR, RUN_JSON
from trainer.runfolder.reader import read_run_json
from trainer.runfolder.records import TS, Record, clean_value, encode_record


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write beside the file, then rename over it; the temporary name is this process's own,
    so two writers (two sweeps sharing a root) never rename each other's half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
        record = {TS: round(time.time(), 3), **record}
        handle = self._handles.get(log_name)
        if handle is None:
            handle = open(self.logs_dir / log_name, "a", encoding="utf-8")
            self._handles[log_name] = handle
        handle.write(encode_record(record))
        handle.flush()

    def append(self, record: Record) -> None:
        """Write a typed record (``TrainRecord``, ``EvalRecord``, ...) to its own log."""
        self.write(record.LOG, record.as_dict())

    def event(self, event: str, step: int | None = None, **details: Any) -> None:
        self.write(EVENTS_LOG, {"event": event, "step": step, **details})

    def update_run(self, **fields: Any) -> dict:
        """Merge fields into run.json (status, end time, ...) atomically."""
        current = read_run_json(self.output_dir, max_bytes=None)
        current.update(fields)
        current["updated_at"] = round(time.time(), 3)
        if self.enabled:
            write_json_atomic(self.output_dir / RUN_JSON, current)
        return current

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
