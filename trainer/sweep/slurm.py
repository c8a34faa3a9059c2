"""``sweep --backend slurm``: the sweep as one SLURM job array, and what the queue says about it.

One array task per unfinished job (its index is the job's place in the sweep, the same every time);
each task runs ``scripts/slurm_task.sh`` -> ``launch_training.sh`` into the job's own folder. The batch
script (trainer/sweep/slurm_script.py) asks SLURM to requeue on preemption or node failure
(``--requeue``) and to warn it before the time limit (``--signal=B:USR1@grace``); slurm_task.sh turns
either into checkpoint, exit, requeue, and the trainer resumes exactly. Submitting again skips finished
jobs and jobs still queued or running.

The submission is recorded in ``<root>/sweep.json`` (``backend: slurm``, each job's array task id) and
``<root>/slurm/`` (every submitted script, kept); ``sweep status`` adds the queue's state. Standard
library only: SLURM's commands are called as programs.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from trainer.runfolder import read_run_json
from trainer.runfolder.slurm import task_id
from trainer.sweep import locks, status
from trainer.sweep.jobs import Job, Sweep, SweepError, job_info
from trainer.sweep.slurm_script import SLURM_DIR, SlurmOptions, render_script, slurm_options

__all__ = [
    "SlurmOptions",
    "SweepError",
    "queue_states",
    "refresh",
    "render_status",
    "slurm_options",
    "submit",
]

# squeue states of a job that will still run (or is running): such a job is never submitted twice.
ACTIVE = {
    "PENDING": "queued",
    "REQUEUED": "queued",
    "REQUEUE_HOLD": "queued",
    "REQUEUE_FED": "queued",
    "CONFIGURING": "running",
    "RUNNING": "running",
    "COMPLETING": "running",
    "RESIZING": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "running",
    "SUSPENDED": "running",
    "STOPPED": "running",
}


# ---------------------------------------------------------------- the queue


def _run(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SweepError(
            f"{command[0]}: not found; run this on a SLURM login node (or add it to PATH)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SweepError(f"{command[0]}: no answer in {timeout:.0f} s (is slurmctld up?)") from None


def queue_states(array_ids: list[str]) -> dict[str, dict]:
    """``{"<array>_<index>": {state, reason}}`` from squeue, then sacct for tasks squeue no longer lists.

    sacct needs SLURM's accounting database; where there is none its answer is simply left out."""
    ids = sorted({str(i) for i in array_ids if i})
    if not ids:
        return {}
    result = _run(["squeue", "--noheader", "--array", f"--jobs={','.join(ids)}", "--format=%F|%K|%T|%r"])
    if result.returncode != 0 and "Invalid job id" not in result.stderr:
        raise SweepError(f"squeue failed (exit {result.returncode}): {result.stderr.strip()[:300]}")
    states: dict[str, dict] = {}
    for line in result.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[1].isdigit():
            states[f"{parts[0]}_{parts[1]}"] = {"state": parts[2], "reason": parts[3] or None}
    if shutil.which("sacct"):
        accounting = _run(["sacct", "--noheader", "--parsable2", "-X", f"--jobs={','.join(ids)}",
                           "--format=JobID,State,ExitCode"])  # fmt: skip
        if accounting.returncode == 0:
            for line in accounting.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) == 3 and re.fullmatch(r"\d+_\d+", parts[0]) and parts[0] not in states:
                    states[parts[0]] = {"state": parts[1].split()[0], "reason": None, "exit_code": parts[2]}
    return states


def job_state(job_dir: Path, queue: dict | None) -> str:
    """The sweep's word for a job (status.STATES) from its folder and the queue's view of its task."""
    if status.job_finished(job_dir):
        return "done"
    if queue and queue.get("state") in ACTIVE:
        return ACTIVE[queue["state"]]
    run_status = read_run_json(job_dir).get("status")
    if queue and queue.get("state") in ("FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"):
        return "failed"
    if run_status == "failed":
        return "failed"
    return "interrupted"  # not finished and no longer queued: submitting again resumes it


# ---------------------------------------------------------------- submit and status


def _previous(root: Path) -> dict[str, dict]:
    summary = status.read_sweep_json(root)
    jobs = summary.get("jobs") if isinstance(summary.get("jobs"), list) else []
    return {j["name"]: j for j in jobs if isinstance(j, dict) and isinstance(j.get("name"), str)}


def _job_entry(job: Job, state: str, slurm: dict | None, message: str = "") -> dict:
    info = job_info(job)
    return {
        "name": job.name,
        "state": state,
        "message": message,
        "progress": status.progress(job.output_dir),
        "slurm": slurm,
        **{k: info[k] for k in ("output_dir", "log", "config", "config_name", "dataset", "seed")},
        **{k: info[k] for k in ("experiment", "params", "overrides")},
    }


def sweep_summary(sweep: Sweep, jobs: list[dict], submissions: list[dict], final_status: str) -> dict:
    """sweep.json for a SLURM sweep; jobs of earlier submissions that ``--only`` left out keep their entry."""
    names = {j["name"] for j in jobs}
    jobs = jobs + [j for name, j in _previous(sweep.root).items() if name not in names]
    return {
        "sweep": sweep.name,
        "sweep_file": str(sweep.file),
        "root": str(sweep.root),
        "backend": "slurm",
        "host": locks.HOST,
        "status": final_status,
        "updated_at": round(time.time(), 3),
        "retries": sweep.retries,
        "counts": {s: sum(1 for j in jobs if j["state"] == s) for s in status.STATES},
        "gpus": [],
        "submissions": submissions,
        "jobs": jobs,
    }


def submit(sweep: Sweep, opts: SlurmOptions, dry_run: bool = False, out: TextIO | None = None) -> int:
    """Submit the unfinished jobs that are not queued or running already as one array; 0 when done."""
    out = out or sys.stdout
    previous = _previous(sweep.root)
    known = [(previous.get(job.name) or {}).get("slurm") or {} for job in sweep.jobs]
    array_ids = [s.get("array_job_id") for s in known if s.get("array_job_id")]
    queue = queue_states(array_ids) if array_ids and (not dry_run or shutil.which("squeue")) else {}
    todo: list[tuple[int, Job]] = []
    entries: list[dict] = []
    skipped = {"done": 0, "queued": 0}
    for job, slurm in zip(sweep.jobs, known):
        current = queue.get(slurm.get("id") or "")
        if status.job_finished(job.output_dir):
            entries.append(_job_entry(job, "done", slurm or None, "finished: skipped"))
            skipped["done"] += 1
        elif current and current["state"] in ACTIVE:
            slurm = {**slurm, **current, "checked_at": round(time.time(), 3)}
            entries.append(_job_entry(job, ACTIVE[current["state"]], slurm, f"already {current['state']}"))
            skipped["queued"] += 1
        else:
            todo.append((job.index, job))
            entries.append(_job_entry(job, "queued", None))
    print(
        f"sweep {sweep.name}: {len(sweep.jobs)} jobs, {skipped['done']} finished, {skipped['queued']} queued or "
        f"running already, {len(todo)} to submit; root {sweep.root}",
        file=out,
    )
    if not todo:
        return 0
    script = render_script(sweep, opts, todo)
    if dry_run:
        print(script, file=out, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise SweepError("sbatch: not found; run this on a SLURM login node (or add it to PATH)")
    folder = sweep.root / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = _new_script(folder, script)
    result = _run(["sbatch", "--parsable", str(path)])
    if result.returncode != 0:
        print(
            f"error: sbatch {path} failed (exit {result.returncode}): {result.stderr.strip()}",
            file=sys.stderr,
        )
        return 1
    array_job_id = result.stdout.strip().split(";")[0]
    submitted_at = round(time.time(), 3)
    by_name = {job.name: index for index, job in todo}
    for entry in entries:
        if entry["name"] in by_name:
            index = by_name[entry["name"]]
            entry["slurm"] = {
                "array_job_id": array_job_id,
                "array_task_id": index,
                "id": task_id(array_job_id, array_job_id, index),
                "state": "PENDING",
                "reason": None,
                "submitted_at": submitted_at,
                "checked_at": submitted_at,
            }
    submissions = status.read_sweep_json(sweep.root).get("submissions") or []
    submissions = [s for s in submissions if isinstance(s, dict)] + [
        {"array_job_id": array_job_id, "script": str(path), "submitted_at": submitted_at, "tasks": len(todo)}
    ]
    status.write_sweep_json(sweep.root, sweep_summary(sweep, entries, submissions, "submitted"))
    print(
        f"submitted array job {array_job_id}: {len(todo)} tasks; script {path}\n"
        f"  progress: python -m trainer sweep status {shlex.quote(str(sweep.file))}",
        file=out,
    )
    return 0


def _new_script(folder: Path, script: str) -> Path:
    """``submit-<time>.sbatch``, never over an earlier one: each submission's script stays on record."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = folder / f"submit-{stamp}{f'-{n}' if n else ''}.sbatch"
        try:
            with open(path, "x") as handle:
                handle.write(script)
            return path
        except FileExistsError:
            continue
    raise SweepError(f"{folder}: could not find a free name for the batch script")


def refresh(sweep: Sweep) -> dict:
    """sweep.json with each job's queue state now (squeue/sacct) and its run folder's progress."""
    previous = _previous(sweep.root)
    known = {job.name: (previous.get(job.name) or {}).get("slurm") or {} for job in sweep.jobs}
    queue = queue_states([s.get("array_job_id") for s in known.values()])
    now = round(time.time(), 3)
    entries = []
    for job in sweep.jobs:
        slurm = dict(known[job.name]) or None
        current = queue.get((slurm or {}).get("id") or "")
        if slurm is not None:
            slurm.update(current or {"state": None, "reason": None})
            slurm["checked_at"] = now
        entries.append(_job_entry(job, job_state(job.output_dir, current), slurm))
    active = any(e["state"] in ("queued", "running") for e in entries)
    final = "running" if active else ("finished" if all(e["state"] == "done" for e in entries) else "stopped")
    submissions = status.read_sweep_json(sweep.root).get("submissions") or []
    summary = sweep_summary(sweep, entries, submissions, final)
    status.write_sweep_json(sweep.root, summary)
    return summary


def render_status(summary: dict, out: TextIO) -> None:
    """One line per job: state, SLURM id and state, attempt, progress."""
    counts = summary.get("counts", {})
    text = " · ".join(f"{counts.get(s, 0)} {s}" for s in status.STATES if counts.get(s))
    print(
        f"sweep {summary['sweep']} ({summary.get('status')}): {len(summary['jobs'])} jobs: {text}", file=out
    )
    width = max([3] + [len(j["name"]) for j in summary["jobs"]])
    print(f"{'JOB':<{width}}  {'STATE':<11} {'SLURM':<14} {'QUEUE':<10} {'TRY':<3}  PROGRESS", file=out)
    for job in summary["jobs"]:
        slurm = job.get("slurm") or {}
        ran = read_run_json(Path(job["output_dir"])).get("slurm") or {}
        tries = ran.get("restart_count")
        attempt = str(tries + 1) if isinstance(tries, int) else ""
        prog = status.progress_text(job)
        queue = slurm.get("state") or "-"
        print(
            f"{job['name']:<{width}}  {job['state']:<11} {slurm.get('id') or '-':<14} {queue:<10} "
            f"{attempt:<3}  {prog}".rstrip(),
            file=out,
        )
