"""Sweeps: plan, GPU slots, locks, retries, restart after a kill; fake jobs, and one real trainer sweep.

The fake job behaves like the trainer where the sweep can tell: it writes a training log, checkpoints
every step, resumes from its latest checkpoint, saves and exits 143 on SIGTERM, and marks run.json
finished. It also appends what it saw (GPU, pid, times, resume step) to ``jobs.jsonl`` for the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, TINY, deep_merge, trainer_env, wait_for
from trainer.cli import main
from trainer.sweep import locks, status
from trainer.sweep.jobs import SweepError
from trainer.sweep.spec import load_sweep

FAKE_JOB = r"""
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
sets = dict(a.split("=", 1) for a in args[args.index("--config") + 3 :: 2])
out = Path(sets["paths.output_dir"])
(out / "logs").mkdir(parents=True, exist_ok=True)
here = Path(__file__).parent
behaviour = json.loads((here / "behaviour.json").read_text()) if (here / "behaviour.json").exists() else {}
me = {**behaviour.get("default", {}), **behaviour.get(out.name, {})}
steps = int(sets.get("training.max_steps", 3))
done = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")]
start = max(done, default=0)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))

def note(**kw):
    with open(here / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job": out.name, "pid": os.getpid(), "ts": time.time(), **kw}) + "\n")

tries = out / "tries"
attempt = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(attempt))
note(event="start", gpu=os.environ.get("CUDA_VISIBLE_DEVICES"), resumed_from=start or None, attempt=attempt,
     workers=sets.get("performance.dataloader_num_workers"))
print(f"fake job {out.name} attempt {attempt} from step {start}", flush=True)
for step in range(start + 1, steps + 1):
    time.sleep(me.get("step_seconds", 0.1))
    with open(out / "logs" / "training_log.jsonl", "a") as f:
        f.write(json.dumps({"ts": time.time(), "step": step, "total_steps": steps}) + "\n")
    (out / f"checkpoint-{step}").mkdir()
    if attempt <= me.get("fail_attempts", 0):
        print("Traceback: fake failure: boom at step", step, flush=True)
        note(event="end", code=me.get("exit_code", 1))
        sys.exit(me.get("exit_code", 1))
    if stop:
        (out / "run.json").write_text(json.dumps({"status": "interrupted", "step": step}))
        note(event="end", code=143)
        sys.exit(143)
(out / f"final-checkpoint-{steps}").mkdir()
(out / "run.json").write_text(json.dumps({"status": "finished", "step": steps, "total_steps": steps}))
note(event="end", code=0)
"""


@pytest.fixture
def fake(tmp_path):
    """A folder with the fake job, a base config and a helper writing sweep files."""
    (tmp_path / "fake_job.py").write_text(FAKE_JOB)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(deep_merge(TINY, {"paths": {"output_dir": str(tmp_path / "unused")}})))

    def write(extra: dict | None = None, behaviour: dict | None = None) -> Path:
        spec = {
            "name": "fake",
            "output_root": str(tmp_path / "sweep"),
            "configs": {"base": str(base)},
            "command": [sys.executable, str(tmp_path / "fake_job.py")],
            **(extra or {}),
        }
        path = tmp_path / "sweep.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        (tmp_path / "behaviour.json").write_text(json.dumps(behaviour or {}))
        return path

    write.dir = tmp_path
    write.root = tmp_path / "sweep"
    return write


def notes(folder: Path) -> list[dict]:
    path = folder / "jobs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sweep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "sweep", *args, "--plain", "--poll", "0.05"]


def run_sweep(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        sweep_cmd(*args), cwd=cwd, env=trainer_env(), capture_output=True, text=True, timeout=timeout
    )


def start_sweep(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        sweep_cmd(*args),
        cwd=cwd,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- the plan


def test_plan_names_overrides_and_env_tuning(fake, tmp_path):
    path = fake(
        {
            "datasets": {"sst2": {"eval.task": "sst2"}, "cola": {"eval.task": "cola", "EVAL_BATCH_SIZE": 4}},
            "grid": {"lora.variant": ["lora", "dora"], "lora.r": [8]},
            "seeds": [1, 2],
            "set": {"training": {"max_steps": 5}},
            "env_tuning": {"NUM_WORKERS": "4", "PIN_MEMORY": "1"},
        }
    )
    sweep = load_sweep(path, cli_tune=["OMP_NUM_THREADS=2"], cli_set=["optimization.learning_rate=1e-4"])
    names = [job.name for job in sweep.jobs]
    assert names[:4] == [
        "base_sst2_variant-lora_r8_seed1",
        "base_sst2_variant-lora_r8_seed2",
        "base_sst2_variant-dora_r8_seed1",
        "base_sst2_variant-dora_r8_seed2",
    ]
    assert len(names) == 8 and len(set(names)) == 8
    assert load_sweep(path).jobs[0].name == names[0]  # stable across reads
    job = next(j for j in sweep.jobs if j.name == "base_cola_variant-dora_r8_seed2")
    assert job.experiment == "base_variant-dora_r8" and job.dataset == "cola" and job.seed == 2
    assert job.output_dir == fake.root / job.name
    assert job.overrides == {
        "performance.dataloader_num_workers": 4,
        "performance.pin_memory": True,
        "training.max_steps": 5,
        "eval.task": "cola",
        "eval.batch_size": 4,
        "lora.variant": "dora",
        "lora.r": 8,
        "training.seed": 2,
        "performance.torch_threads": 2,
        "optimization.learning_rate": 1e-4,
    }
    # a grid axis may use an old tuning name too; its label is the name as written
    grid = load_sweep(fake({"grid": {"NUM_WORKERS": [0, 2]}})).jobs
    assert [j.name for j in grid] == ["base_num-workers0", "base_num-workers2"]
    assert grid[1].overrides == {"performance.dataloader_num_workers": 2}
    labelled = fake({"grid": {"NUM_WORKERS": [2], "optimization.learning_rate": ["1e-4"]},
                     "names": {"optimization.learning_rate": "lr", "NUM_WORKERS": "nw"}})  # fmt: skip
    assert [j.name for j in load_sweep(labelled).jobs] == ["base_nw2_lr0.0001"]
    long = load_sweep(fake({"grid": {"model.revision": ["x" * 200]}})).jobs[0].name
    assert len(long) == 120 and long.startswith("base_revision-xxx") and long[-9] == "-"
    with pytest.raises(SweepError, match="two jobs would both be named 'base_revision-a-b'"):
        load_sweep(fake({"grid": {"model.revision": ["a b", "a/b"]}}))


def test_dry_run_prints_the_plan_and_starts_nothing(fake, capsys):
    path = fake({"grid": {"lora.r": [4, 8, 16]}, "set": {"NUM_WORKERS": 2}})
    assert main(["sweep", str(path), "--gpus", "0,1", "--gpu-plan", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 jobs (0 finished, 3 to run); slots gpu 0 x1, gpu 1 x1 (2 at once)" in out
    assert "[todo] base_r4  (starts on gpu 0)" in out
    assert "[todo] base_r8  (starts on gpu 1)" in out
    assert "[todo] base_r16  (waits for a free slot)" in out
    assert (
        f"--set performance.dataloader_num_workers=2 --set lora.r=16 --set paths.output_dir={fake.root}/base_r16"
        in out
    )
    assert not fake.root.exists()


@pytest.mark.parametrize(
    ("extra", "args", "message"),
    [
        ({"grid": {"lora.rr": [1]}}, [], "unknown config key 'lora.rr' (did you mean 'r'?)"),
        (
            {"set": {"PREFETCH_FACTOR": 2}},
            [],
            "PREFETCH_FACTOR does not apply here",
        ),
        ({"env_tuning": {"PIN_MEMORY": "maybe"}}, [], "PIN_MEMORY expects 1/0 or true/false"),
        ({"grid": {"lora.r": 8}}, [], "grid.lora.r: expected a non-empty list of values"),
        ({"seedz": [1]}, [], "unknown key 'seedz' (did you mean 'seeds'?)"),
        ({}, ["--gpus", "0,1", "--gpu-plan", "1,2,3"], "--gpu-plan: 3 numbers for 2 GPUs"),
        ({}, ["--gpus", "0,0"], "--gpus: an id appears twice"),
        ({}, ["--tune", "lora.r=3"], "--tune 'lora.r=3': expected one of"),
        ({}, ["--only", "nomatch*"], "--only nomatch*: matches none of the 1 jobs"),
        ({"configs": ["missing.yaml"]}, [], "configs.missing: file not found"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(fake, capsys, extra, args, message):
    path = fake(extra)
    assert main(["sweep", str(path), "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_trainer_jobs_are_validated_before_anything_starts(fake, capsys):
    path = fake({"grid": {"lora.r": [8, 0]}, "command": None})
    assert main(["sweep", str(path), "--gpus", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: job base_r0: ") and "lora.r: expected a rank > 0, got 0" in err
    assert not fake.root.exists()  # not even the first, valid job started
    with pytest.raises(SweepError, match="lora.r: expected a rank > 0, got 0"):
        load_sweep(path)


# ---------------------------------------------------------------- running


def overlaps(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at once."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = current = 0
    for _, delta in edges:
        current += delta
        most = max(most, current)
    return most


@pytest.mark.slow
def test_slots_per_gpu_are_honoured_and_locks_record_the_job(fake):
    path = fake(
        {"grid": {"lora.r": [1, 2, 3, 4, 5, 6, 7]}, "set": {"training.max_steps": 4}},
        {"default": {"step_seconds": 0.15}},
    )
    proc = start_sweep(str(path), "--gpus", "0,1", "--gpu-plan", "2,1", cwd=fake.dir)
    lock_path = fake.root / "base_r1" / locks.LOCK_NAME
    assert wait_for(lambda: locks.read_lock(lock_path.parent).get("pid"), timeout=60)
    held = locks.read_lock(lock_path.parent)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    starts = {n["pid"]: n for n in notes(fake.dir) if n["event"] == "start"}
    ends = {n["pid"]: n for n in notes(fake.dir) if n["event"] == "end"}
    assert held["pid"] in starts and starts[held["pid"]]["job"] == "base_r1"
    assert held["host"] == locks.HOST and held["sweep_pid"] == proc.pid and held["started_at"] > 0
    assert locks.read_lock(lock_path.parent)["released_at"] is not None
    per_gpu = {"0": [], "1": []}
    for pid, start in starts.items():
        per_gpu[start["gpu"]].append((start["ts"], ends[pid]["ts"]))
    assert overlaps(per_gpu["0"]) == 2 and overlaps(per_gpu["1"]) == 1  # full, never over
    assert len(starts) == 7
    summary = status.read_sweep_json(fake.root)
    assert summary["status"] == "finished" and summary["counts"]["done"] == 7
    assert summary["gpus"] == [
        {"gpu": "0", "slots": 2, "running": []},
        {"gpu": "1", "slots": 1, "running": []},
    ]
    job = next(j for j in summary["jobs"] if j["name"] == "base_r3")
    assert job["attempts"] == 1 and job["progress"] == {"step": 4, "total_steps": 4, "fraction": 1.0}
    assert job["output_dir"] == str(fake.root / "base_r3") and job["gpu"] in ("0", "1")
    assert "fake job base_r3 attempt 1" in (fake.root / "base_r3" / "job.log").read_text()
    again = run_sweep(str(path), "--gpus", "0,1", cwd=fake.dir)
    assert again.returncode == 0 and "7 jobs, 7 finished already" in again.stdout
    assert len([n for n in notes(fake.dir) if n["event"] == "start"]) == 7


@pytest.mark.slow
def test_two_sweeps_at_once_start_each_job_once(fake):
    path = fake(
        {"grid": {"lora.r": [1, 2, 3, 4]}, "set": {"training.max_steps": 3}},
        {"default": {"step_seconds": 0.2}},
    )
    first = start_sweep(str(path), "--gpus", "0", "--gpu-plan", "2", cwd=fake.dir)
    second = start_sweep(str(path), "--gpus", "1", "--gpu-plan", "2", cwd=fake.dir)
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, out1 + out2
    started = [n["job"] for n in notes(fake.dir) if n["event"] == "start"]
    assert sorted(started) == ["base_r1", "base_r2", "base_r3", "base_r4"]
    assert "running elsewhere" in out1 + out2


@pytest.mark.slow
def test_stale_lock_is_taken_over_and_a_live_one_waited_for(fake):
    path = fake({"grid": {"lora.r": [1, 2]}, "set": {"training.max_steps": 2}})
    stale_dir, live_dir = fake.root / "base_r1", fake.root / "base_r2"
    gone = dead_pid()
    stale_dir.mkdir(parents=True)
    (stale_dir / locks.LOCK_NAME).write_text(
        json.dumps({"job": "base_r1", "host": locks.HOST, "pid": gone, "sweep_pid": gone, "started_at": 1.0})
    )
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_dir.mkdir(parents=True)
        live = {
            "host": locks.HOST,
            "pid": holder.pid,
            "pid_start": locks.process_start(holder.pid),
            "started_at": 2.0,
        }
        (live_dir / locks.LOCK_NAME).write_text(json.dumps(live))
        proc = start_sweep(str(path), "--gpus", "0", "--gpu-plan", "2", cwd=fake.dir)
        assert wait_for(lambda: status.job_finished(stale_dir), timeout=60)
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting for the job held by the live process
        assert status.read_sweep_json(fake.root)["counts"]["held"] == 1
        # the holder finishes the job itself and goes away
        (live_dir / "run.json").write_text(json.dumps({"status": "finished"}))
        holder.kill()
        out, _ = proc.communicate(timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 0, out
    assert (
        f"base_r1: took over a stale lock (pid {gone} on {locks.HOST}" in out
        and "that process is gone" in out
    )
    assert f"base_r2: running elsewhere (pid {holder.pid} on {locks.HOST}" in out
    assert "base_r2: finished by another process" in out
    assert [n["job"] for n in notes(fake.dir) if n["event"] == "start"] == ["base_r1"]


@pytest.mark.slow
def test_failed_job_is_retried_then_reported_with_its_log(fake):
    path = fake(
        {"grid": {"lora.r": [1, 2, 3]}, "set": {"training.max_steps": 3}, "retries": 1},
        {
            "base_r1": {"fail_attempts": 9},
            "base_r2": {"fail_attempts": 1},
            "base_r3": {"fail_attempts": 9, "exit_code": 2},
        },
    )
    result = run_sweep(str(path), "--gpus", "0", "--gpu-plan", "3", cwd=fake.dir)
    assert result.returncode == 1, result.stdout
    starts = [n for n in notes(fake.dir) if n["event"] == "start"]
    assert [n["attempt"] for n in starts if n["job"] == "base_r1"] == [1, 2]
    assert [n["resumed_from"] for n in starts if n["job"] == "base_r2"] == [
        None,
        1,
    ]  # retried from its checkpoint
    assert [n["attempt"] for n in starts if n["job"] == "base_r3"] == [1]  # exit 2: bad input, not retried
    assert "FAILED base_r1: failed 2 time(s), last exit 1" in result.stdout
    assert "  | Traceback: fake failure: boom at step 1" in result.stdout
    assert "FAILED base_r3: bad input (exit 2): not retried" in result.stdout
    jobs = {j["name"]: j for j in status.read_sweep_json(fake.root)["jobs"]}
    assert jobs["base_r2"]["state"] == "done" and jobs["base_r2"]["attempts"] == 2
    assert jobs["base_r1"]["state"] == "failed" and jobs["base_r1"]["exit_code"] == 1
    assert any("boom" in line for line in jobs["base_r1"]["last_log_lines"])


@pytest.mark.slow
def test_killed_sweep_restarts_without_redoing_finished_jobs(fake):
    path = fake(
        {
            "datasets": {"long": {"training.max_steps": 60}, "short": {"training.max_steps": 1}},
            "seeds": [1, 2],
        },
        {"default": {"step_seconds": 0.1}},
    )
    long_dirs = [fake.root / f"base_long_seed{s}" for s in (1, 2)]
    short_dirs = [fake.root / f"base_short_seed{s}" for s in (1, 2)]
    proc = start_sweep(str(path), "--gpus", "0", "--gpu-plan", "3", cwd=fake.dir)
    assert wait_for(lambda: all(status.job_finished(d) for d in short_dirs), timeout=60)
    assert wait_for(
        lambda: all((status.progress(d) or {}).get("step", 0) >= 3 for d in long_dirs), timeout=60
    )
    proc.kill()  # SIGKILL: no chance to tidy up; the jobs get SIGTERM from the kernel and checkpoint
    proc.wait()
    assert wait_for(lambda: all(json.loads((d / "run.json").read_text() or "{}").get("status") == "interrupted"
                                for d in long_dirs if (d / "run.json").exists()) and
                    all((d / "run.json").exists() for d in long_dirs), timeout=30)  # fmt: skip
    assert all(locks.read_lock(d)["released_at"] is None for d in long_dirs)  # left behind by the kill
    result = run_sweep(str(path), "--gpus", "0", "--gpu-plan", "3", cwd=fake.dir)
    assert result.returncode == 0, result.stdout
    assert "4 jobs, 2 finished already" in result.stdout
    assert result.stdout.count("took over a stale lock") == 2
    starts = [n for n in notes(fake.dir) if n["event"] == "start"]
    for d in short_dirs:
        assert [n["job"] for n in starts].count(d.name) == 1
    for d in long_dirs:
        resumed = [n["resumed_from"] for n in starts if n["job"] == d.name]
        assert len(resumed) == 2 and resumed[0] is None and resumed[1] >= 3
        assert status.job_finished(d)


@pytest.mark.slow
def test_sigterm_stops_jobs_cleanly_and_says_so(fake):
    path = fake({"set": {"training.max_steps": 100}}, {"default": {"step_seconds": 0.05}})
    proc = start_sweep(str(path), "--gpus", "cpu", cwd=fake.dir)
    job_dir = fake.root / "base"
    assert wait_for(lambda: (status.progress(job_dir) or {}).get("step", 0) >= 2, timeout=60)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "SIGTERM: stopping" in out and "base: stopped by the sweep (exit 143); resumes next time" in out
    summary = status.read_sweep_json(fake.root)
    assert summary["status"] == "interrupted" and summary["jobs"][0]["state"] == "interrupted"
    assert locks.read_lock(job_dir)["released_at"] is not None
    start = next(n for n in notes(fake.dir) if n["event"] == "start")
    assert start["gpu"] == ""  # the cpu slot hides every GPU


def test_live_table_shows_states_gpus_and_progress():
    snapshot = {
        "sweep": "demo",
        "counts": {"queued": 1, "running": 2, "done": 1, "failed": 1},
        "gpus": [{"gpu": "0", "slots": 3, "running": ["a", "b"]}, {"gpu": "1", "slots": 1, "running": []}],
        "jobs": [
            {"name": "d", "state": "done", "gpu": "1", "attempts": 1, "started_at": 0, "ended_at": 65},
            {"name": "q", "state": "queued", "gpu": None, "attempts": 0},
            {"name": "a", "state": "running", "gpu": "0", "attempts": 1, "started_at": 90,
             "progress": {"step": 5, "total_steps": 10, "fraction": 0.5}},
            {"name": "b", "state": "running", "gpu": "0", "attempts": 2, "started_at": 95, "progress": None},
            {"name": "f", "state": "failed", "gpu": "1", "attempts": 2, "started_at": 0, "ended_at": 3},
        ],
    }  # fmt: skip
    lines = status.render_table(snapshot, now=100).splitlines()
    assert lines[0].startswith("sweep demo  5 jobs: 1 queued · 2 running · 1 done · 1 failed · 0 interrupted")
    assert lines[1] == "GPU 0   [##-] 2/3  a 50%  b"
    assert lines[2] == "GPU 1   [-] 0/1"
    assert [line.split()[0] for line in lines[4:]] == ["a", "b", "f", "q", "d"]
    assert lines[4].split()[1:5] == ["running", "0", "1", "[#####-----]"] and "5/10" in lines[4]
    assert "[##########] done" in lines[-1] and lines[-1].endswith("1m05s")
    short = status.render_table(snapshot, now=100, max_rows=2).splitlines()
    assert short[-1] == "... 3 more (1 queued, 1 done, 1 failed)"


# ---------------------------------------------------------------- the real trainer


@pytest.mark.slow
def test_real_trainer_sweep_resumes_after_sigterm(tmp_path):
    """Two real tiny jobs side by side; SIGTERM mid-run; the restart skips the finished one and resumes the other."""
    base = tmp_path / "base.yaml"
    tiny = deep_merge(TINY, {"data": {"max_length": 32}, "training": {"micro_batch_size": 2, "save_steps": 2},
                             "eval": {"interval": 2, "max_batches": 1}, "logging": {"telemetry_interval": 5.0}})  # fmt: skip
    tiny["lora"]["target_modules"] = ["q_proj", "v_proj"]
    base.write_text(yaml.safe_dump(tiny))
    spec = {
        "name": "real",
        "output_root": str(tmp_path / "sweep"),
        "configs": {"tiny": str(base)},
        "datasets": {"short": {"training.max_steps": 2}, "long": {"training.max_steps": 400}},
        "env_tuning": {"OMP_NUM_THREADS": 1},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    short, long = tmp_path / "sweep" / "tiny_short", tmp_path / "sweep" / "tiny_long"
    proc = start_sweep("sweep.yaml", "--gpus", "0,1", cwd=tmp_path)
    assert wait_for(lambda: status.job_finished(short), timeout=300), (short / "job.log").read_text()[-2000:]
    assert wait_for(lambda: (status.progress(long) or {}).get("step", 0) >= 1, timeout=120)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert json.loads((long / "run.json").read_text())["status"] == "interrupted"
    stopped_at = json.loads((long / "run.json").read_text())["step"]
    assert (long / f"checkpoint-{stopped_at}").is_dir()
    # finish the long job quickly on the restart: the same job, fewer steps (grid keys name it, not `set`)
    spec["datasets"]["long"]["training.max_steps"] = stopped_at + 2
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    again = run_sweep("sweep.yaml", "--gpus", "0,1", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout + (long / "job.log").read_text()[-3000:]
    assert "2 jobs, 1 finished already" in again.stdout
    events = [json.loads(line) for line in (long / "logs" / "events.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == stopped_at
    assert json.loads((long / "run.json").read_text())["status"] == "finished"
    short_starts = [
        e for e in (short / "logs" / "events.jsonl").read_text().splitlines() if '"run_start"' in e
    ]
    assert len(short_starts) == 1
    job_log = (long / "job.log").read_text()
    assert (
        "attempt 1 on gpu" in job_log and "attempt 2 on gpu" not in job_log
    )  # the restart is attempt 1 again
    assert "--set performance.torch_threads=1" in job_log


def test_shipped_example_validates_and_plans(capsys):
    sweep = load_sweep(REPO / "configs" / "sweep_example.yaml")
    assert len(sweep.jobs) == 24 and sweep.jobs[0].name == "tiny_corpus_variant-lora_r8_seed1"
    assert sweep.jobs[0].overrides["performance.dataloader_num_workers"] == 2
    assert main(["sweep", str(REPO / "configs" / "sweep_example.yaml"), "--gpus", "0,1", "--dry-run"]) == 0
    assert "24 jobs (0 finished, 24 to run); slots gpu 0 x2, gpu 1 x2 (4 at once)" in capsys.readouterr().out


def test_shell_wrapper_runs_the_verbs(tmp_path, fake):
    """sweep.sh with a ready virtual environment: the sweep and aggregate verbs, exit codes passed on."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    stamp = subprocess.run("cksum < pyproject.toml", shell=True, cwd=REPO, capture_output=True, text=True)
    for extras in ("train", "dashboard"):
        (venv / f".installed-{extras}-{stamp.stdout.split()[0]}").touch()
    env = {**trainer_env(), "VENV_DIR": str(venv)}
    env.pop("PYTHONPATH")
    path = fake({"grid": {"lora.r": [4, 8]}})
    wrapper = str(REPO / "sweep.sh")
    plan = subprocess.run(
        [wrapper, path.name, "--gpus", "3", "--dry-run"],
        cwd=fake.dir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0 and "[todo] base_r8  (waits for a free slot)" in plan.stdout, plan.stderr
    bad = subprocess.run(
        [wrapper, "aggregate", "--root", "nowhere", "--output", "o"],
        cwd=fake.dir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr == "error: --root: folder not found: nowhere\n"
    usage = subprocess.run([wrapper, "--help"], capture_output=True, text=True)
    assert (
        usage.returncode == 0
        and "./sweep.sh SWEEP.yaml [--gpus 0,1,2,3] [--gpu-plan 3,3,1,3]" in usage.stdout
    )


def test_live_mode_redraws_the_table_in_place(fake, monkeypatch):
    import io

    from trainer.sweep.runner import Runner

    monkeypatch.chdir(fake.dir)
    sweep = load_sweep(fake({"set": {"training.max_steps": 2}}))
    out = io.StringIO()
    assert Runner(sweep, {"7": 1}, out=out, live=True, poll=0.05).run() == 0
    frames = out.getvalue().split("\x1b[H")
    assert len(frames) >= 3  # redrawn in place, not scrolled
    assert "GPU 7   [#] 1/1  base" in out.getvalue() and "base  running" in out.getvalue()
    assert frames[-1].lstrip("\x1b[J").startswith("sweep fake  1 jobs: 0 queued · 0 running · 1 done")


def test_lock_liveness_by_pid_start_and_foreign_heartbeat():
    me = {"host": locks.HOST, "pid": os.getpid(), "pid_start": locks.process_start(os.getpid())}
    assert locks.holder_alive(me)
    assert not locks.holder_alive({**me, "pid_start": "1"})  # the PID was reused by another process
    assert not locks.holder_alive({**me, "released_at": 5.0})
    now = time.time()
    foreign = {"host": "other-node", "pid": 1, "heartbeat_at": now - 60}
    assert locks.holder_alive(foreign, now, foreign_timeout=600)
    assert not locks.holder_alive(foreign, now, foreign_timeout=30)
