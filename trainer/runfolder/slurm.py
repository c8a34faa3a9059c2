"""SLURM in the run folder: which job (and attempt) a process is, and what the runs page shows of it.

The trainer stamps ``run.json``'s ``slurm`` field and each ``run_start`` event with ``slurm_job()``,
so every attempt of a requeued job is on record. ``sweep status`` writes the queue's view
(``squeue``/``sacct``) into the sweep's ``sweep.json``; ``slurm_row`` joins the two for a reader.
Field meanings: docs/run-folder.md. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping

# run.json / run_start field -> the environment variable SLURM sets in a job
_TEXT = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "job_name": "SLURM_JOB_NAME",
    "partition": "SLURM_JOB_PARTITION",
    "nodes": "SLURM_JOB_NODELIST",
    "cluster": "SLURM_CLUSTER_NAME",
}
_INT = {"array_task_id": "SLURM_ARRAY_TASK_ID", "restart_count": "SLURM_RESTART_COUNT"}


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def task_id(job_id, array_job_id=None, array_task_id=None) -> str | None:
    """The id ``squeue`` shows: ``<array job>_<index>`` for an array task, else the job id."""
    if array_job_id not in (None, "") and array_task_id is not None:
        return f"{array_job_id}_{array_task_id}"
    return str(job_id) if job_id not in (None, "") else None


def slurm_job(environ: Mapping[str, str]) -> dict | None:
    """This process's SLURM job, from its environment; None outside SLURM.

    ``restart_count`` is 0 on the first run and counts requeues (preemption, ``scontrol requeue``,
    a node failure); ``id`` is what ``squeue``/``scancel`` take."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    info: dict = {key: environ.get(var) or None for key, var in _TEXT.items()}
    info.update({key: _int(environ.get(var)) for key, var in _INT.items()})
    if info["restart_count"] is None:
        info["restart_count"] = 0
    info["id"] = task_id(info["job_id"], info["array_job_id"], info["array_task_id"])
    return info


def slurm_row(run_info: Mapping, sweep_job: Mapping | None = None) -> dict | None:
    """What the runs page shows: the job id, its queue state when ``sweep status`` last looked, the attempt.

    ``run_info`` is run.json (the trainer's own record of the attempt it ran); ``sweep_job`` the run's
    entry in sweep.json (the submission, and the queue state). Either may be missing; None when the run
    never met SLURM."""
    ran = run_info.get("slurm") if isinstance(run_info.get("slurm"), Mapping) else {}
    queued = (sweep_job or {}).get("slurm")
    queued = queued if isinstance(queued, Mapping) else {}
    if not ran and not queued:
        return None
    restarts = ran.get("restart_count")
    return {
        "id": queued.get("id") or ran.get("id"),
        "state": queued.get("state"),
        "reason": queued.get("reason"),
        "checked_at": queued.get("checked_at"),
        "attempt": restarts + 1 if isinstance(restarts, int) else None,
        "nodes": ran.get("nodes"),
    }
