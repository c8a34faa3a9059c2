"""One lock per job, ``<job folder>/job.lock``: who runs it (PID, host, start time), so two sweeps
never start the same job twice, and a crash leaves nothing to delete by hand.

The lock is a small JSON file. Reading and changing it happens under a short ``flock`` on the file
itself, so two sweeps deciding at the same moment take turns. A lock is alive while the job's
process or the sweep that started it is alive: on this host by PID and process start time (a
reused PID does not count), from another host by a heartbeat the sweep refreshes. A lock whose
holder is gone is taken over, and the caller is told whose it was. Release marks ``released_at``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

LOCK_NAME = "job.lock"
HEARTBEAT_SECONDS = 30.0
FOREIGN_TIMEOUT = 600.0  # a lock from another host with no heartbeat for this long is stale
HOST = socket.gethostname()


class LockHeld(Exception):
    """The job is running elsewhere; ``info`` is the lock's record."""

    def __init__(self, info: dict):
        super().__init__(describe(info))
        self.info = info


def process_start(pid: int | None) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused PID apart."""
    if not pid:
        return None
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid, start: str | None = None) -> bool:
    """True while process ``pid`` exists on this host (and is the one that started at ``start``)."""
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return start is None or process_start(pid) == start


def holder_alive(info: dict, now: float | None = None, foreign_timeout: float = FOREIGN_TIMEOUT) -> bool:
    if not info or info.get("released_at"):
        return False
    if info.get("host") == HOST:
        return pid_alive(info.get("pid"), info.get("pid_start")) or pid_alive(
            info.get("sweep_pid"), info.get("sweep_pid_start")
        )
    beat = info.get("heartbeat_at") or info.get("started_at")
    now = time.time() if now is None else now
    return isinstance(beat, (int, float)) and now - beat < foreign_timeout


def _clock(ts) -> str:
    if not isinstance(ts, (int, float)):
        return "?"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def describe(info: dict) -> str:
    pid = info.get("pid") or info.get("sweep_pid")
    sweep = f", sweep pid {info.get('sweep_pid')}" if info.get("pid") and info.get("sweep_pid") else ""
    return f"pid {pid} on {info.get('host', '?')}{sweep}, since {_clock(info.get('started_at'))}"


@contextlib.contextmanager
def _flocked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing drops the flock


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    try:
        info = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {"unreadable": True}
    return info if isinstance(info, dict) else {"unreadable": True}


def _write(fd: int, info: dict) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(info, indent=2) + "\n").encode())
    os.fsync(fd)


def read_lock(job_dir: Path) -> dict:
    """The lock's record ({} when there is none), for reports and tests."""
    try:
        info = json.loads((Path(job_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class JobLock:
    """A held lock; ``update`` records the job's PID and heartbeats, ``release`` lets it go."""

    def __init__(self, path: Path, record: dict):
        self.path = path
        self.record = record
        self.beat_at = time.monotonic()

    @classmethod
    def acquire(
        cls, job_dir: Path, job: str, sweep: str, foreign_timeout: float = FOREIGN_TIMEOUT
    ) -> tuple[JobLock, dict | None]:
        """Take the job's lock; returns (lock, the stale record taken over or None). Raises LockHeld."""
        job_dir.mkdir(parents=True, exist_ok=True)
        path = job_dir / LOCK_NAME
        now = time.time()
        with _flocked(path) as fd:
            current = _read(fd)
            if holder_alive(current, now, foreign_timeout):
                raise LockHeld(current)
            stale = current if current and not current.get("released_at") else None
            record = {
                "job": job,
                "sweep": sweep,
                "host": HOST,
                "pid": None,
                "pid_start": None,
                "sweep_pid": os.getpid(),
                "sweep_pid_start": process_start(os.getpid()),
                "started_at": round(now, 3),
                "heartbeat_at": round(now, 3),
                "owner": uuid.uuid4().hex,
                "released_at": None,
            }
            _write(fd, record)
        return cls(path, record), stale

    def _change(self, **fields) -> bool:
        with _flocked(self.path) as fd:
            current = _read(fd)
            if current.get("owner") != self.record["owner"]:
                return False  # taken over by someone who thought we were gone: leave theirs alone
            self.record.update(fields)
            _write(fd, self.record)
        return True

    def set_process(self, pid: int) -> None:
        self._change(pid=pid, pid_start=process_start(pid))

    def heartbeat(self, force: bool = False) -> None:
        if force or time.monotonic() - self.beat_at >= HEARTBEAT_SECONDS:
            self.beat_at = time.monotonic()
            self._change(heartbeat_at=round(time.time(), 3))

    def release(self) -> None:
        self._change(released_at=round(time.time(), 3))
