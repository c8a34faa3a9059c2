"""Run a sweep: start jobs as GPU slots free, retry failures, stop cleanly, report.

Each job is a child process in a session of its own, with ``CUDA_VISIBLE_DEVICES`` set to its GPU
and stdout/stderr appended to ``<job>/job.log``. Finished jobs are skipped, jobs locked by a live
process elsewhere are waited for, and a restarted job resumes from its latest checkpoint (the
trainer does that by itself). SIGINT/SIGTERM forward one SIGTERM to every job (the trainer saves
a checkpoint and exits); a second signal kills them. Should the sweep itself be killed outright,
its jobs get SIGTERM from the kernel (Linux parent-death signal) and stop the same way.

Over 400 lines on purpose: ``Runner`` is one state machine (slots, locks, retries, signals,
the table) whose transitions are easiest to check when they are read in one place.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainer.sweep import locks, status
from trainer.sweep.jobs import Job, Sweep, SweepError, job_command, job_info

EXIT_BAD_INPUT = 2
EXIT_SIGNALLED = (130, 143)
REPO_ROOT = Path(__file__).resolve().parents[2]
WRITE_EVERY = 2.0  # seconds between sweep.json refreshes while nothing changes state
HELD_RECHECK = 2.0


@dataclass
class JobRun:
    """One job's state in this sweep process."""

    job: Job
    state: str = "queued"
    gpu: str | None = None
    attempts: int = 0
    exit_code: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    message: str = ""
    held_by: str | None = None
    progress: dict | None = None
    tail: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    lock: locks.JobLock | None = None
    log: object | None = None
    checked_at: float = 0.0

    def snapshot(self) -> dict:
        info = job_info(self.job)
        return {
            "name": self.job.name,
            "state": self.state,
            "gpu": self.gpu,
            "attempts": self.attempts,
            "exit_code": self.exit_code,
            "pid": self.proc.pid if self.proc is not None and self.state == "running" else None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "progress": self.progress,
            "message": self.message,
            "held_by": self.held_by,
            "last_log_lines": self.tail,
            **{k: info[k] for k in ("output_dir", "log", "config", "config_name", "dataset", "seed")},
            **{k: info[k] for k in ("experiment", "params", "overrides")},
        }


def parse_gpus(gpus: str | list[str] | None, plan: str | list[int] | None) -> dict[str, int]:
    """``--gpus 0,1,2,3 --gpu-plan 3,3,1,3`` as {gpu: slots}; one plan number is every GPU's."""
    from trainer.sweep.spec import plan_list

    ids = gpus.split(",") if isinstance(gpus, str) else list(gpus) if gpus else default_gpus()
    ids = [str(g).strip() for g in ids if str(g).strip()]
    if not ids:
        raise SweepError("--gpus: expected GPU ids like 0,1,2,3")
    if len(set(ids)) != len(ids):
        raise SweepError(f"--gpus: an id appears twice in {','.join(ids)}")
    slots = plan_list(plan, "--gpu-plan") or [1]
    if len(slots) == 1:
        slots = slots * len(ids)
    if len(slots) != len(ids):
        raise SweepError(f"--gpu-plan: {len(slots)} numbers for {len(ids)} GPUs; give one, or one per GPU")
    if sum(slots) == 0:
        raise SweepError("--gpu-plan: every GPU has 0 slots; nothing could run")
    return dict(zip(ids, slots))


def default_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES when set, else the GPUs nvidia-smi lists, else one CPU 'gpu'."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()] or ["cpu"]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)] or ["cpu"]


def _parent_death_signal():
    """A preexec function: the child gets SIGTERM when the sweep dies (Linux), else None."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the sweep died before we armed it
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class Runner:
    def __init__(
        self,
        sweep: Sweep,
        slots: dict[str, int],
        retries: int | None = None,
        out: TextIO | None = None,
        live: bool | None = None,
        poll: float = 0.5,
        foreign_timeout: float = locks.FOREIGN_TIMEOUT,
    ):
        self.sweep = sweep
        self.slots = slots
        self.retries = sweep.retries if retries is None else retries
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.poll = poll
        self.foreign_timeout = foreign_timeout
        self.runs = [JobRun(job) for job in sweep.jobs]
        self.events: list[str] = []
        self.stop_signal: int | None = None
        self.forwarded = False
        self.killed = False
        self.started_at = time.time()
        self.dirty = True
        self.written_at = 0.0

    # ------------------------------------------------------------ reporting

    def say(self, message: str) -> None:
        line = f"[{dt.datetime.now().strftime('%H:%M:%S')}] {message}"
        self.events = (self.events + [line])[-8:]
        if not self.live:
            print(line, file=self.out, flush=True)
        self.dirty = True

    def snapshot(self, final_status: str | None = None) -> dict:
        counts = {s: sum(1 for r in self.runs if r.state == s) for s in status.STATES}
        return {
            "sweep": self.sweep.name,
            "sweep_file": str(self.sweep.file),
            "root": str(self.sweep.root),
            "host": locks.HOST,
            "pid": os.getpid(),
            "status": final_status or "running",
            "started_at": round(self.started_at, 3),
            "updated_at": round(time.time(), 3),
            "retries": self.retries,
            "counts": counts,
            "gpus": [
                {
                    "gpu": gpu,
                    "slots": n,
                    "running": [r.job.name for r in self.runs if r.state == "running" and r.gpu == gpu],
                }
                for gpu, n in self.slots.items()
            ],
            "jobs": [r.snapshot() for r in self.runs],
        }

    def publish(self, force: bool = False, final_status: str | None = None) -> None:
        if not (force or self.dirty or time.monotonic() - self.written_at >= WRITE_EVERY):
            return
        snap = self.snapshot(final_status)
        try:
            status.write_sweep_json(self.sweep.root, snap)
        except OSError as exc:  # a full disk must not take the running jobs down with the sweep
            if f"{exc}" not in "".join(self.events[-1:]):
                self.say(f"warning: could not write {status.SWEEP_JSON}: {exc}")
        self.written_at = time.monotonic()
        self.dirty = False
        if self.live and final_status is None:
            rows = max(5, shutil.get_terminal_size((120, 40)).lines - len(self.slots) - 9)
            table = status.render_table(snap, time.time(), max_rows=rows)
            recent = "\n".join(self.events[-5:])
            text = f"{table}\n\n{recent}" if recent else table
            self.out.write("\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[K\x1b[J")
            self.out.flush()

    # ------------------------------------------------------------ jobs

    def free_gpu(self) -> str | None:
        used = {gpu: 0 for gpu in self.slots}
        for r in self.runs:
            if r.state == "running":
                used[r.gpu] += 1
        free = [(self.slots[g] - used[g], -i, g) for i, g in enumerate(self.slots) if used[g] < self.slots[g]]
        return max(free)[2] if free else None

    def job_env(self, gpu: str) -> dict:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = "" if gpu == "cpu" else gpu
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["SWEEP_NAME"] = self.sweep.name
        if self.sweep.command is None:  # `python -m trainer` finds the kit from any working directory
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        return env

    def start(self, run: JobRun, gpu: str) -> None:
        job = run.job
        try:
            lock, stale = locks.JobLock.acquire(
                job.output_dir, job.name, self.sweep.name, self.foreign_timeout
            )
        except locks.LockHeld as held:
            run.state, run.held_by, run.checked_at = "held", str(held), time.monotonic()
            self.say(f"{job.name}: running elsewhere ({held}); waiting for it")
            return
        if status.job_finished(job.output_dir):
            # Another sweep finished it between our last look and taking the lock: nothing to run.
            lock.release()
            run.state, run.held_by, run.message = "done", None, "finished by another process"
            self.say(f"{job.name}: finished by another process")
            return
        if stale is not None:
            self.say(f"{job.name}: took over a stale lock ({locks.describe(stale)}): that process is gone")
        run.attempts += 1
        run.gpu, run.held_by, run.exit_code, run.message = gpu, None, None, ""
        run.started_at, run.ended_at = time.time(), None
        command = job_command(self.sweep, job)
        log = open(job.log_path, "ab")
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        header = (
            f"==== sweep {self.sweep.name}: attempt {run.attempts} on gpu {gpu}, {stamp}, host {locks.HOST}\n"
        )
        log.write(header.encode() + f"$ {shlex.join(command)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.job_env(gpu),
                cwd=self.sweep.cwd,
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )
        except OSError as exc:
            log.close()
            lock.release()
            run.state, run.ended_at, run.message = (
                "failed",
                time.time(),
                f"could not start {command[0]}: {exc}",
            )
            self.say(f"{job.name}: {run.message}")
            return
        lock.set_process(proc.pid)
        run.proc, run.lock, run.log, run.state = proc, lock, log, "running"
        retry = f" (attempt {run.attempts}/{self.retries + 1})" if run.attempts > 1 else ""
        self.say(f"{job.name}: started on {'cpu' if gpu == 'cpu' else 'gpu ' + gpu}{retry}, pid {proc.pid}")

    def finish(self, run: JobRun, code: int) -> None:
        job = run.job
        run.exit_code, run.ended_at = code, time.time()
        run.log.close()
        run.lock.release()
        run.proc = run.lock = run.log = None
        run.progress = status.progress(job.output_dir) or run.progress
        run.tail = status.log_tail(job.log_path, 20)
        finished = status.job_finished(job.output_dir)
        if code == 0 and finished:
            run.state, run.message = "done", ""
            self.say(f"{job.name}: done")
        elif self.stop_signal is not None and (code in EXIT_SIGNALLED or code < 0):
            run.state, run.message = "interrupted", f"stopped by the sweep (exit {code}); resumes next time"
            self.say(f"{job.name}: {run.message}")
        elif code == EXIT_BAD_INPUT:
            run.state, run.message = "failed", "bad input (exit 2): not retried; see the log"
            self.say(f"{job.name}: failed, {run.message}")
        elif code == 0:
            run.state = "failed"
            run.message = f"exited 0 but {job.output_dir}/run.json does not say finished"
            self.say(f"{job.name}: failed, {run.message}")
        elif run.attempts <= self.retries:
            run.state = "queued"
            run.message = f"attempt {run.attempts} failed (exit {code}); retrying from its latest checkpoint"
            self.say(f"{job.name}: {run.message}")
        else:
            run.state = "failed"
            run.message = f"failed {run.attempts} time(s), last exit {code}"
            self.say(f"{job.name}: {run.message}")
        self.dirty = True

    def recheck_held(self, run: JobRun) -> None:
        if time.monotonic() - run.checked_at < HELD_RECHECK:
            return
        run.checked_at = time.monotonic()
        if status.job_finished(run.job.output_dir):
            run.state, run.held_by, run.message = "done", None, "finished by another process"
            run.progress = status.progress(run.job.output_dir)
            self.say(f"{run.job.name}: {run.message}")
        else:
            info = locks.read_lock(run.job.output_dir)
            if locks.holder_alive(info, foreign_timeout=self.foreign_timeout):
                run.progress = status.progress(run.job.output_dir)
            else:
                run.state, run.held_by = "queued", None
                self.dirty = True

    # ------------------------------------------------------------ the loop

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.killed = True

    def _signal_jobs(self, sig: int) -> None:
        for run in self.runs:
            if run.proc is not None:
                try:
                    os.killpg(run.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def prepare(self) -> None:
        """Before starting anything: finished jobs are done, jobs locked elsewhere are held."""
        self.sweep.root.mkdir(parents=True, exist_ok=True)
        for run in self.runs:
            if status.job_finished(run.job.output_dir):
                run.state, run.message = "done", "finished before this sweep started"
                run.progress = status.progress(run.job.output_dir)
                continue
            info = locks.read_lock(run.job.output_dir)
            if locks.holder_alive(info, foreign_timeout=self.foreign_timeout):
                run.state, run.held_by = "held", locks.describe(info)
                run.checked_at = time.monotonic()
                self.say(f"{run.job.name}: running elsewhere ({run.held_by}); waiting for it")
        done = sum(r.state == "done" for r in self.runs)
        held = sum(r.state == "held" for r in self.runs)
        slots = ", ".join(f"{'cpu' if g == 'cpu' else 'gpu ' + g} x{n}" for g, n in self.slots.items())
        self.say(
            f"sweep {self.sweep.name}: {len(self.runs)} jobs, {done} finished already"
            + (f", {held} running elsewhere" if held else "")
            + f"; slots {slots}; root {self.sweep.root}"
        )

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.prepare()
            self.publish(force=True)
            while True:
                for run in self.runs:
                    if run.proc is not None:
                        code = run.proc.poll()
                        if code is None:
                            run.lock.heartbeat()
                            run.progress = status.progress(run.job.output_dir) or run.progress
                        else:
                            self.finish(run, code)
                if self.stop_signal is not None and not self.forwarded:
                    self.forwarded = True
                    name = signal.Signals(self.stop_signal).name
                    self.say(f"{name}: stopping; each running job saves a checkpoint and exits")
                    self._signal_jobs(signal.SIGTERM)
                if self.killed:
                    self._signal_jobs(signal.SIGKILL)
                if self.stop_signal is None:
                    for run in self.runs:
                        if run.state == "held":
                            self.recheck_held(run)
                    for run in self.runs:
                        if run.state != "queued":
                            continue
                        gpu = self.free_gpu()
                        if gpu is None:
                            break
                        self.start(run, gpu)
                running = any(r.proc is not None for r in self.runs)
                waiting = any(r.state in ("queued", "held") for r in self.runs)
                if not running and (self.stop_signal is not None or not waiting):
                    break
                self.publish()
                time.sleep(self.poll)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.report()

    def report(self) -> int:
        failed = [r for r in self.runs if r.state == "failed"]
        if self.stop_signal is not None:
            final, code = "interrupted", 128 + self.stop_signal
        elif failed:
            final, code = "failed", 1
        else:
            final, code = "finished", 0
        self.publish(force=True, final_status=final)
        if self.live:
            self.out.write("\x1b[H\x1b[J")
        print(status.render_table(self.snapshot(final), time.time()), file=self.out)
        for run in failed:
            print(f"\nFAILED {run.job.name}: {run.message}\n  log: {run.job.log_path}", file=self.out)
            for line in run.tail:
                print(f"  | {line}", file=self.out)
        print(f"\nsweep {final}: summary in {self.sweep.root / status.SWEEP_JSON}", file=self.out, flush=True)
        return code


def dry_run(sweep: Sweep, slots: dict[str, int], out: TextIO | None = None) -> int:
    """Print the plan: every job, whether it would run, its first GPU if known, its command."""
    out = out or sys.stdout
    runs = [(job, status.job_finished(job.output_dir)) for job in sweep.jobs]
    todo = [job for job, finished in runs if not finished]
    first_wave: dict[str, str] = {}
    free = dict(slots)
    for job in todo:
        candidates = [(n, -i, g) for i, (g, n) in enumerate(free.items()) if n > 0]
        if not candidates:
            break
        gpu = max(candidates)[2]
        free[gpu] -= 1
        first_wave[job.name] = gpu
    slot_text = ", ".join(f"{'cpu' if g == 'cpu' else 'gpu ' + g} x{n}" for g, n in slots.items())
    print(
        f"sweep {sweep.name}: {len(runs)} jobs ({len(runs) - len(todo)} finished, {len(todo)} to run); "
        f"slots {slot_text} ({sum(slots.values())} at once); retries {sweep.retries}; root {sweep.root}",
        file=out,
    )
    for job, finished in runs:
        if finished:
            print(f"  [done] {job.name}  (finished: skipped)", file=out)
            continue
        gpu = first_wave.get(job.name)
        where = f"starts on {'cpu' if gpu == 'cpu' else 'gpu ' + gpu}" if gpu else "waits for a free slot"
        print(f"  [todo] {job.name}  ({where})", file=out)
        print(f"         {shlex.join(job_command(sweep, job))}", file=out)
    return 0
