"""What a sweep is once read: its jobs, and each job as the command line and sweep.json entry it gets.

The runners (local GPU slots, SLURM) and ``sweep status`` need only this, not the sweep file's rules.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class SweepError(ValueError):
    """A problem with the sweep file or the command line, phrased for the user in one line."""


@dataclass(frozen=True)
class Job:
    """One training run of the sweep."""

    name: str
    config: str  # absolute path of the base config
    config_name: str
    dataset: str | None
    seed: Any
    experiment: str  # the name without dataset and seed: what seeds are averaged over
    params: dict[str, Any]  # the grid values that make this job differ
    overrides: dict[str, Any]  # every `--set` it gets, in the order they apply
    output_dir: Path
    index: int = 0  # place in the whole sweep (before --only): a SLURM array task's index

    @property
    def log_path(self) -> Path:
        return self.output_dir / "job.log"


@dataclass
class Sweep:
    name: str
    file: Path
    root: Path
    jobs: list[Job]
    retries: int = 1
    command: list[str] | None = None  # None: python -m trainer train
    gpus: list[str] | None = None
    gpu_plan: list[int] | None = None
    cwd: Path = field(default_factory=Path.cwd)
    backend: str = "local"  # local: GPU slots on this machine; slurm: one SLURM job array
    slurm: dict | None = None  # the file's slurm: section, read by trainer.sweep.slurm


def render_value(value: Any) -> str:
    """A value as ``--set`` reads it back (YAML): plain where unambiguous, else JSON (valid YAML)."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_/.~][\w./~+-]*", value):
        if yaml.safe_load(value) == value:
            return value
    return json.dumps(value)


def set_arguments(job: Job) -> list[str]:
    """The job's overrides as ``--set`` arguments, output folder last."""
    args: list[str] = []
    for key, value in job.overrides.items():
        args += ["--set", f"{key}={render_value(value)}"]
    return args + ["--set", f"paths.output_dir={job.output_dir}"]


def job_command(sweep: Sweep, job: Job) -> list[str]:
    base = sweep.command or [sys.executable, "-m", "trainer", "train"]
    return [*base, "--config", job.config, *set_arguments(job)]


def job_info(job: Job) -> dict:
    """What sweep.json records about a job's identity (aggregate and the dashboard read it)."""
    info = dataclasses.asdict(job)
    info["output_dir"] = str(job.output_dir)
    info["log"] = str(job.log_path)
    return info
