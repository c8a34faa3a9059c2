"""run.json and the events that open and close a run: what a reader of the run folder sees of its life.

A run ends in exactly one of three ways: finished, interrupted (a signal, or a second Ctrl-C) or
failed; each writes run.json's status and one run_end event, then closes the log.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

from trainer import runfolder
from trainer.config import Config, dump_config


def library_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "flash-linear-attention"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


def run_hosts() -> list[str]:
    """Every process's host name, each once, rank 0's first: a collective, so every rank calls it."""
    from accelerate.utils import gather_object

    return list(dict.fromkeys(gather_object([socket.gethostname()])))


def record_config(cfg: Config, output_dir: Path, step: int) -> Path:
    """Write the config as used without ever rewriting the run's first one: config.yaml reproduces the run.

    A resume with the same config writes nothing; one with a different config (a --set, an --extend) writes
    ``config-resume-<step>.yaml`` beside it. Returns the file that holds the config now in force.
    """
    first = output_dir / runfolder.CONFIG_YAML
    if not first.exists():
        dump_config(cfg, first)
        return first
    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / runfolder.CONFIG_YAML
        dump_config(cfg, candidate)
        if candidate.read_text() == first.read_text():
            return first
        changed = output_dir / runfolder.CONFIG_RESUME.format(step=step)
        shutil.copyfile(candidate, changed)
        return changed


def start_run(
    log: runfolder.RunLog, cfg: Config, output_dir: Path, loaded, data, world: int, total_steps: int, step: int,
    resume_from, config_source: str | None,
) -> None:  # fmt: skip
    """config.yaml as used, run.json (kept across resumes: id, start, resume count), the opening events.

    Every rank calls it (the hosts are gathered from all of them); only rank 0's ``log`` writes."""
    hosts = run_hosts()
    if log.enabled:
        written = record_config(cfg, output_dir, step)
        if written.name != runfolder.CONFIG_YAML:
            log.event("config_changed", step=step, file=written.name)
    run_info = runfolder.read_run_json(output_dir)
    slurm = runfolder.slurm_job(os.environ)  # this attempt's SLURM job (None outside SLURM)
    log.update_run(
        run_id=run_info.get("run_id") or f"{output_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        started_at=run_info.get("started_at") or round(time.time(), 3),
        ended_at=None,
        status="running",
        model=cfg.model.name_or_path,
        family=loaded.family.name,
        model_type=loaded.model_type,
        method=cfg.training.method,
        world_size=world,
        hosts=hosts,
        pid=os.getpid(),
        total_steps=total_steps,
        step=step,
        versions=library_versions(),
        output_dir=str(output_dir),
        config_source=config_source,
        resumes=run_info.get("resumes", 0) + (1 if resume_from else 0),
        slurm=slurm,
    )
    log.event(
        "run_start", step=step, resumed=resume_from is not None, world_size=world, total_steps=total_steps,
        **({"slurm": slurm} if slurm else {}),
    )  # fmt: skip
    if resume_from is not None:
        log.event("resume", step=step, from_checkpoint=str(resume_from.path))
    log.event("data_report", step=step, **data.report.as_event())
    log.event("model_report", step=step, **loaded.report)
    checks = (loaded.report.get("fast_path") or {}).get("self_check")
    if checks:  # the fast path's kernels against eager PyTorch on this device (trainer/fastpath/selfcheck.py)
        log.event("kernel_check", step=step, passed=all(c["passed"] for c in checks), results=checks)


def end_run(log: runfolder.RunLog, status: str, step: int, final_loss, best) -> None:
    """A run that finished or stopped on a signal."""
    log.update_run(status=status, step=step, ended_at=round(time.time(), 3))
    log.event("run_end", step=step, status=status, final_loss=final_loss, best_metric=best)
    log.close()


def record_failure(log: runfolder.RunLog, exc: BaseException, step: int, rank: int) -> None:
    """Fatal errors go to error_log.jsonl and run.json before the exception propagates."""
    log.append(
        runfolder.ErrorRecord(
            step=step,
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            rank=rank,
        )
    )
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    if (log.output_dir / runfolder.RUN_JSON).exists():
        log.update_run(status=status, step=step, ended_at=round(time.time(), 3))
    log.event("run_end", step=step, status=status, error=type(exc).__name__)
    log.close()
