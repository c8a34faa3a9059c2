"""Is the process that writes a run folder still there? One rule for ``list`` and the dashboard.

run.json names the rank-0 ``pid`` and the ``hosts`` the run uses, rank 0's first. On rank 0's host,
a run that says ``running`` but whose rank-0 process is gone died without a word (SIGKILL, the OOM
killer, a node reboot): it is ``dead`` at once. From any other host the pid means nothing, so
only the age of its last record can tell (the dashboard's "stalled"). Standard library only.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOST = socket.gethostname()


def process_alive(pid) -> bool:
    """True while ``pid`` is a live process here (someone else's counts); a zombie counts as gone."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): trust kill(0)
    return state not in ("Z", "X")  # killed but not yet reaped by its parent


def process_gone(info: dict, host: str = HOST) -> bool:
    """run.json says ``running`` with rank 0 on this host, and its pid is no longer a live process here."""
    hosts = info.get("hosts")
    return (
        info.get("status") == "running"
        and isinstance(hosts, list)
        and hosts[:1] == [host]
        and info.get("pid") is not None
        and not process_alive(info.get("pid"))
    )


def effective_status(info: dict, host: str = HOST) -> str:
    """run.json's status, except ``dead`` for a running run whose process is gone from this host."""
    if process_gone(info, host):
        return "dead"
    return info.get("status") or "unknown"
