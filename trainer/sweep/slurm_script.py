"""The batch script of a SLURM sweep: the sweep file's ``slurm:`` options, checked, and the sbatch
script they give (one ``case`` branch per array index). trainer/sweep/slurm.py submits it.

Standard library only.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainer.sweep import locks
from trainer.sweep.jobs import Job, Sweep, SweepError, set_arguments

KIT_ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = "slurm"  # <root>/slurm/: submitted scripts and SLURM's own output files
_DURATION = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^\d+-\d+$|^(UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?$")


@dataclass
class SlurmOptions:
    """The sweep file's ``slurm:`` section, overridden by ``--slurm KEY=VALUE`` (docs/sweeps.md)."""

    partition: str | None = None
    time: str | None = None  # --time: minutes, HH:MM:SS or D-HH:MM:SS
    gpus_per_job: int = 0  # --gres=gpu:N for each task (0: a CPU job)
    cpus_per_task: int | None = None
    mem: str | None = None  # --mem, e.g. 64G
    account: str | None = None
    qos: str | None = None
    max_parallel: int | None = None  # --array=...%N: at most N tasks at once
    signal_grace: int = 300  # seconds before the time limit to save and requeue (SIGUSR1)
    num_processes: int | None = None  # launch_training.sh --num_processes (default: the task's GPUs)
    job_name: str | None = None  # default: sweep-<name>
    setup: list[str] = field(default_factory=list)  # shell lines first in every task (module load ...)
    sbatch_args: list[str] = field(default_factory=list)  # any other sbatch flags, verbatim


_INT_KEYS = {"gpus_per_job": 0, "cpus_per_task": 1, "max_parallel": 1, "signal_grace": 0, "num_processes": 1}
_LIST_KEYS = ("setup", "sbatch_args")


def _option(key: str, value: Any, where: str) -> Any:
    if key in _INT_KEYS:
        low = _INT_KEYS[key]
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SweepError(f"{where}: expected an integer >= {low}, got {value!r}")
        return value
    if key in _LIST_KEYS:
        if isinstance(value, str):
            value = [value] if key == "setup" else shlex.split(value)
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise SweepError(f"{where}: expected a list of strings, got {value!r}")
        return [str(v) for v in value]
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
        raise SweepError(
            f"{where}: expected a value like {'01:00:00' if key == 'time' else 'gpu'}, got {value!r}"
        )
    value = str(value).strip()
    if key == "time" and not _DURATION.match(value):
        raise SweepError(f"{where}: expected a SLURM time like 90, 04:00:00 or 1-12:00:00, got {value!r}")
    if key == "mem" and not _MEM.match(value.upper()):
        raise SweepError(f"{where}: expected a memory size like 64G or 16000M, got {value!r}")
    return value


def slurm_options(raw: Any, cli: list[str] = ()) -> SlurmOptions:
    """The file's ``slurm:`` mapping, then ``--slurm KEY=VALUE`` flags; each mistake is one line."""
    names = [f.name for f in fields(SlurmOptions)]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SweepError(f"slurm: expected a mapping ({', '.join(names)}), got {raw!r}")
    values: dict[str, Any] = {}
    items = [(str(k), v, f"slurm.{k}") for k, v in raw.items()]
    for text in cli:
        key, sep, value = text.partition("=")
        if not sep:
            raise SweepError(f"--slurm {text!r}: expected KEY=VALUE, e.g. partition=gpu")
        items.append((key.strip().replace("-", "_"), value, f"--slurm {key.strip()}"))
    for key, value, where in items:
        if key not in names:
            import difflib

            near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise SweepError(
                f"{where}: unknown SLURM option {key!r}{hint}; expected one of {', '.join(names)}"
            )
        values[key] = _option(key, value, where)
    return SlurmOptions(**values)


# ---------------------------------------------------------------- the batch script


def sbatch_directives(sweep: Sweep, opts: SlurmOptions, indices: list[int]) -> list[str]:
    array = ",".join(str(i) for i in indices) + (f"%{opts.max_parallel}" if opts.max_parallel else "")
    lines = [
        f"--job-name={opts.job_name or 'sweep-' + sweep.name}",
        f"--array={array}",
        "--nodes=1",
        "--ntasks=1",
        "--requeue",
        f"--signal=B:USR1@{opts.signal_grace}",
        "--open-mode=append",
        f"--output={sweep.root / SLURM_DIR / '%A_%a.out'}",
    ]
    optional = {
        "partition": opts.partition,
        "time": opts.time,
        "cpus-per-task": opts.cpus_per_task,
        "mem": opts.mem,
        "account": opts.account,
        "qos": opts.qos,
    }
    lines += [f"--{key}={value}" for key, value in optional.items() if value is not None]
    if opts.gpus_per_job:
        lines.append(f"--gres=gpu:{opts.gpus_per_job}")
    return lines + opts.sbatch_args


def task_command(sweep: Sweep, job: Job, opts: SlurmOptions) -> list[str]:
    """What the array task runs: launch_training.sh (or the file's ``command``) with the job's overrides."""
    if sweep.command:
        base = list(sweep.command)
    else:
        base = [str(KIT_ROOT / "launch_training.sh"), "--max_restarts", str(sweep.retries)]
        if opts.num_processes is not None:
            base += ["--num_processes", str(opts.num_processes)]
    return [*base, "--config", job.config, *set_arguments(job)]


def render_script(sweep: Sweep, opts: SlurmOptions, todo: list[tuple[int, Job]]) -> str:
    """The sbatch script: directives, then one ``case`` branch per array index, readable as it is."""
    head = [
        "#!/usr/bin/env bash",
        f"# Sweep {sweep.name} ({sweep.file}): written by `python -m trainer sweep --backend slurm`",
        f"# on {locks.HOST}, {dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}; {len(todo)} of "
        f"{len(sweep.jobs)} jobs. Each task appends to <job folder>/job.log. docs/sweeps.md explains it.",
    ]
    head += [f"#SBATCH {shlex.quote(line)}" for line in sbatch_directives(sweep, opts, [i for i, _ in todo])]
    body = [
        "set -uo pipefail",
        f"cd {shlex.quote(str(sweep.cwd))}",
        f"export SWEEP_NAME={shlex.quote(sweep.name)} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1",
        *opts.setup,
        'case "${SLURM_ARRAY_TASK_ID:-}" in',
    ]
    for index, job in todo:
        command = " ".join(shlex.quote(part) for part in task_command(sweep, job, opts))
        body += [
            f"  {index})  # {job.name}",
            f"    job_dir={shlex.quote(str(job.output_dir))}",
            f"    command=({command}) ;;",
        ]
    body += [
        '  *) echo "sweep: no job for array index ${SLURM_ARRAY_TASK_ID:-unset}" >&2; exit 2 ;;',
        "esac",
        f'exec bash {shlex.quote(str(KIT_ROOT / "scripts" / "slurm_task.sh"))} "$job_dir" -- "${{command[@]}}"',
    ]
    return "\n".join(head + [""] + body) + "\n"
