"""What a job folder says (finished? how far?), the sweep summary file, and the terminal table.

``sweep.json`` (``<sweep root>/sweep.json``) is rewritten atomically as jobs move; the table in the
terminal is rendered from the same dict, so the two never disagree. Fields: docs/sweeps.md.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from trainer import runfolder
from trainer.runfolder import SWEEP_JSON

STATES = ("queued", "held", "running", "done", "failed", "interrupted")
# Order of jobs in the table: what needs attention first.
TABLE_ORDER = ("running", "failed", "held", "interrupted", "queued", "done")


def job_finished(job_dir: Path) -> bool:
    """run.json says finished, or a final checkpoint is on disk."""
    if runfolder.read_run_json(job_dir).get("status") == "finished":
        return True
    try:
        return any(
            entry.name.startswith(runfolder.FINAL_PREFIX)
            and runfolder.checkpoint_step(entry.name) is not None
            and entry.is_dir()
            for entry in os.scandir(job_dir)
        )
    except OSError:
        return False


def _tail(path: Path, nbytes: int) -> tuple[bytes, bool]:
    """The last ``nbytes`` of a file, and whether that cut a line (the file is longer)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - nbytes))
            return handle.read(), size > nbytes
    except OSError:
        return b"", False


def progress(job_dir: Path) -> dict | None:
    """``{step, total_steps, fraction}`` from the last training record (None before the first)."""
    tail = runfolder.tail_records(runfolder.log_path(job_dir, runfolder.TRAINING_LOG), nbytes=16384)
    for record in reversed(tail):
        if isinstance(record.get("step"), int):
            step, total = record["step"], record.get("total_steps")
            if not isinstance(total, int) or total <= 0:
                total = runfolder.read_run_json(job_dir).get("total_steps")
            fraction = min(1.0, step / total) if isinstance(total, int) and total > 0 else None
            return {"step": step, "total_steps": total, "fraction": fraction}
    return None


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last lines of a job log; a progress bar's carriage returns keep only its last state."""
    text = _tail(path, 32768)[0].decode("utf-8", errors="replace")
    rows = [row.split("\r")[-1].rstrip() for row in text.splitlines()]
    rows = [row for row in rows if row.strip()]
    return rows[-lines:]


def read_sweep_json(root: Path) -> dict:
    return runfolder.read_json_object(Path(root) / SWEEP_JSON, max_bytes=None)


def write_sweep_json(root: Path, payload: dict) -> None:
    """Atomically (through a temporary file of this process's own: two sweeps may share a root)."""
    root.mkdir(parents=True, exist_ok=True)
    runfolder.write_json_atomic(root / SWEEP_JSON, payload)


# ---------------------------------------------------------------- the table


def _bar(fraction: float | None, width: int = 10) -> str:
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _elapsed(job: dict, now: float) -> str:
    start = job.get("started_at")
    if not isinstance(start, (int, float)):
        return ""
    end = job.get("ended_at") if job.get("state") != "running" else now
    seconds = int(max(0, (end or now) - start))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def progress_text(job: dict) -> str:
    """A job's progress bar and step/total, as the tables show it."""
    prog = job.get("progress") or {}
    if job.get("state") == "done":
        return _bar(1.0) + " done"
    if not prog:
        return ""
    total = prog.get("total_steps") or "?"
    return f"{_bar(prog.get('fraction'))} {prog.get('step')}/{total}"


def render_table(snapshot: dict, now: float, max_rows: int = 40) -> str:
    """The live view: counts, each GPU's slots, then the jobs that need attention first."""
    counts = snapshot.get("counts", {})
    when = dt.datetime.fromtimestamp(now).strftime("%H:%M:%S")
    summary = " · ".join(f"{counts.get(s, 0)} {s}" for s in STATES if counts.get(s) or s != "held")
    lines = [f"sweep {snapshot.get('sweep')}  {len(snapshot.get('jobs', []))} jobs: {summary}   {when}"]
    by_name = {j["name"]: j for j in snapshot.get("jobs", [])}
    for gpu in snapshot.get("gpus", []):
        running = gpu.get("running", [])
        used = len(running)
        slots = "#" * used + "-" * max(0, gpu["slots"] - used)
        label = "cpu" if gpu["gpu"] == "cpu" else f"GPU {gpu['gpu']}"
        cells = []
        for name in running:
            fraction = ((by_name.get(name) or {}).get("progress") or {}).get("fraction")
            cells.append(f"{name} {fraction * 100:.0f}%" if fraction is not None else name)
        lines.append((f"{label:<7} [{slots}] {used}/{gpu['slots']}  " + "  ".join(cells)).rstrip())
    jobs = sorted(
        snapshot.get("jobs", []),
        key=lambda j: TABLE_ORDER.index(j["state"]) if j["state"] in TABLE_ORDER else len(TABLE_ORDER),
    )
    width = max([len("JOB")] + [len(j["name"]) for j in jobs[:max_rows]])
    lines.append(f"{'JOB':<{width}}  {'STATE':<11} {'GPU':<4} {'TRY':<3}  {'PROGRESS':<22} ELAPSED")
    for job in jobs[:max_rows]:
        gpu = "" if job.get("gpu") is None else str(job["gpu"])
        note = job.get("held_by") if job["state"] == "held" else ""
        lines.append(
            f"{job['name']:<{width}}  {job['state']:<11} {gpu:<4} {job.get('attempts', 0):<3}  "
            f"{progress_text(job):<22} {_elapsed(job, now)} {note or ''}".rstrip()
        )
    if len(jobs) > max_rows:
        hidden = jobs[max_rows:]
        kinds = {s: sum(1 for j in hidden if j["state"] == s) for s in STATES}
        lines.append(f"... {len(hidden)} more (" + ", ".join(f"{n} {s}" for s, n in kinds.items() if n) + ")")
    return "\n".join(lines)
