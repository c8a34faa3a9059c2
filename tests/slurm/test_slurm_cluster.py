"""Sweeps and multi-node runs on a real SLURM cluster (two nodes on this host, started by the test).

A sweep submitted as a job array: one job is preempted with `scontrol requeue`, then, on its second
attempt, warned of its time limit (SIGUSR1 to the batch shell, what `--signal=B:USR1@grace` sends);
every job finishes exactly once, and the interrupted job's per-step losses equal those of the job that
ran uninterrupted. A two-node `srun scripts/slurm_train.sh` run: the rendezvous from SLURM's
environment, one world of two ranks, requeued mid-run and resumed.

Needs root and Debian's slurm-wlm + munge (run_tests.sh installs them); tests/slurm/cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, TINY, deep_merge, trainer_env, wait_for
from tests.slurm.cluster import Cluster, missing_programs
from trainer import runfolder
from trainer.runfolder import iter_records, last_per_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_programs()
    if missing or os.geteuid() != 0:
        pytest.fail(
            f"a real SLURM test needs root and slurm-wlm + munge (missing: {', '.join(missing) or 'none'}, "
            f"uid {os.geteuid()}): apt-get install -y slurm-wlm munge, or run ./run_tests.sh as root"
        )
    with Cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def sweep(cluster: Cluster, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**trainer_env(), **{"SLURM_CONF": cluster.env["SLURM_CONF"]}, "VENV_DIR": sys.prefix}
    return subprocess.run(
        [sys.executable, "-m", "trainer", "sweep", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def losses(run: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in last_per_step(list(iter_records(run / "logs" / runfolder.TRAINING_LOG)))
    }


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == kind]


def queue(cluster: Cluster, array_id: str) -> dict[str, tuple[str, str]] | None:
    """The job's tasks in the queue; None when squeue did not answer (a busy slurmctld), which is not empty."""
    done = cluster.run("squeue", "-h", "-r", f"-j{array_id}", "-o%i|%T|%r", check=False)
    if done.returncode != 0:  # a job purged from slurmctld's memory is "Invalid job id": gone, not unknown
        return {} if "invalid job id" in (done.stderr or "").lower() else None
    return {
        line.split("|")[0]: tuple(line.split("|")[1:]) for line in done.stdout.splitlines() if "|" in line
    }


def left_queue(cluster: Cluster, array_id: str) -> bool:
    return queue(cluster, array_id) == {}


def steps_done(run: Path) -> int:
    return max(losses(run), default=0) if (run / "logs" / runfolder.TRAINING_LOG).exists() else 0


def requeued_now(cluster: Cluster, task: str, array_id: str) -> None:
    """Wait until the task is back in the queue, then shorten SLURM's requeue delay (BeginTime, ~2 min) to 5 s."""
    assert wait_for(lambda: (queue(cluster, array_id) or {}).get(task, ("",))[0] == "PENDING", timeout=90), (
        queue(cluster, array_id),
        cluster.logs(),
    )
    # Not "now": a task that requeued itself may be allocated again within milliseconds, while its previous
    # instance is still being cleaned up on the node, and slurmctld then kills it ("Job credential revoked").
    cluster.run("scontrol", "update", f"JobId={task}", "StartTime=now+5")


def test_sweep_on_slurm_survives_preemption_and_time_limit(cluster, tmp_path):
    base = deep_merge(TINY, {"training": {"max_steps": 60}, "logging": {"telemetry_interval": 5.0}})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "name": "onslurm",
        "output_root": str(tmp_path / "runs"),
        "configs": {"tiny": str(tmp_path / "base.yaml")},
        # Two jobs that train identically: how often they save changes nothing in the losses.
        "grid": {"training.save_steps": [3, 5]},
        "names": {"training.save_steps": "save"},
        "env_tuning": {"OMP_NUM_THREADS": 1},
        "slurm": {"cpus_per_task": 1, "signal_grace": 30},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    submitted = sweep(cluster, "sweep.yaml", "--backend", "slurm", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "2 jobs, 0 finished, 0 queued or running already, 2 to submit" in submitted.stdout
    array_id = submitted.stdout.split("submitted array job ")[1].split(":")[0]
    stopped, steady = (tmp_path / "runs" / f"tiny_save{n}" for n in (3, 5))
    task = f"{array_id}_0"

    # Preemption: `scontrol requeue` sends every process of the job SIGTERM, then requeues it.
    assert wait_for(lambda: steps_done(stopped) >= 5 or left_queue(cluster, array_id), timeout=240), (
        cluster.logs() + _log(stopped)
    )
    cluster.run("scontrol", "requeue", task)
    requeued_now(cluster, task, array_id)

    # Then the time limit's warning on the second attempt: SIGUSR1 to the batch shell only (what
    # --signal=B:USR1@grace sends); the task has the trainer save and stop, then requeues itself.
    def resumed_and_stepped() -> bool:
        resume = events(stopped, "resume")
        return bool(resume) and steps_done(stopped) >= resume[0]["step"] + 3

    assert wait_for(lambda: resumed_and_stepped() or left_queue(cluster, array_id), timeout=240), _log(
        stopped
    )
    cluster.run("scancel", "--batch", "--signal=USR1", task)
    requeued_now(cluster, task, array_id)

    assert wait_for(lambda: left_queue(cluster, array_id), timeout=420, interval=1), queue(cluster, array_id)
    reference = losses(steady)
    assert sorted(reference) == list(range(1, 61))
    for run in (stopped, steady):
        info = json.loads((run / "run.json").read_text())
        assert info["status"] == "finished" and info["step"] == 60, _log(run) + cluster.logs(40)
        assert [e["status"] for e in events(run, "run_end")].count("finished") == 1
        assert len(list(run.glob("final-checkpoint-*"))) == 1
        assert info["slurm"]["array_job_id"] == array_id
        assert losses(run).keys() == reference.keys()
        for step, loss in reference.items():
            assert abs(losses(run)[step] - loss) < 1e-6, (run.name, step, losses(run)[step], loss)
    starts = events(stopped, "run_start")
    assert [s["slurm"]["restart_count"] for s in starts] == [0, 1, 2], _log(stopped)
    assert {s["slurm"]["id"] for s in starts} == {task}
    signals = events(stopped, "signal")
    assert [e["signal"] for e in signals] == ["SIGTERM", "SIGTERM"]
    assert [e["step"] for e in events(stopped, "resume")] == [e["step"] for e in signals]
    log = _log(stopped)
    assert all(f"attempt {n} on" in log for n in (1, 2, 3)), log
    assert "SIGUSR1: time limit near" in log and f"requeueing job {starts[0]['slurm']['job_id']}" in log
    assert [s["slurm"]["restart_count"] for s in events(steady, "run_start")] == [0]
    assert "attempt 2 on" not in _log(steady)

    status = sweep(cluster, "status", "sweep.yaml", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "2 jobs: 2 done" in status.stdout and task in status.stdout
    again = sweep(cluster, "sweep.yaml", "--backend", "slurm", cwd=tmp_path)
    assert again.returncode == 0 and "2 finished, 0 queued or running already, 0 to submit" in again.stdout
    assert "submitted" not in again.stdout


def _log(run: Path) -> str:
    path = run / "job.log"
    return path.read_text() if path.exists() else f"(no {path})"


def test_two_node_training_under_srun_takes_its_rendezvous_from_slurm_and_survives_a_requeue(
    cluster, tmp_path
):
    """slurm_train.sh on both nodes: rank, machines and main host from SLURM; one gloo world of two ranks
    (ACCELERATE_USE_CPU: accelerate's multi-process launch on CPUs); requeued mid-run, it resumes."""
    script = REPO / "scripts" / "slurm_train.sh"
    mapping = cluster.run(
        "srun", "-N2", "--ntasks-per-node=1", "bash", str(script), "--print", "--config", "c.yaml"
    )
    lines = sorted(line for line in mapping.stdout.splitlines() if line.startswith("node "))
    port = lines[0].rsplit(" ", 1)[1]
    assert lines == [
        f"node n{n + 1}: NUM_PROCESSES=2 ACCELERATE_ARGS=--num_machines 2 --machine_rank {n} --main_process_ip n1 "
        f"--main_process_port {port}"
        for n in (0, 1)
    ], mapping.stdout

    run = tmp_path / "run"
    config = deep_merge(TINY, {"paths": {"output_dir": str(run)}, "training": {"max_steps": 30},
                               "logging": {"telemetry_interval": 5.0}})  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "job.sh").write_text(
        "#!/usr/bin/env bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append\n"
        f"#SBATCH --output={tmp_path / 'job.out'}\n"
        f"srun bash {script} --config {tmp_path / 'c.yaml'}\n"
    )
    # The node names here do not resolve (both are this host): the main process is reached at 127.0.0.1.
    env = {**trainer_env(), "SLURM_CONF": cluster.env["SLURM_CONF"], "VENV_DIR": sys.prefix, "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "1", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(free_port())}  # fmt: skip
    job = subprocess.run(
        ["sbatch", "--parsable", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True
    )
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    assert wait_for(lambda: steps_done(run) >= 4 or left_queue(cluster, job_id), timeout=240), _out(tmp_path)
    cluster.run("scontrol", "requeue", job_id)
    requeued_now(cluster, job_id, job_id)
    assert wait_for(lambda: left_queue(cluster, job_id), timeout=240, interval=1), _out(tmp_path)

    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["world_size"] == 2, _out(tmp_path)
    starts = events(run, "run_start")
    assert [(s["world_size"], s["slurm"]["restart_count"]) for s in starts] == [(2, 0), (2, 1)]
    assert [e["signal"] for e in events(run, "signal")] == ["SIGTERM"]  # both ranks stopped at one step
    assert [e["step"] for e in events(run, "resume")] == [events(run, "signal")[0]["step"]]
    records = list(iter_records(run / "logs" / runfolder.TRAINING_LOG))
    assert sorted({r["step"] for r in records}) == list(range(1, 31))  # rank 0 alone writes the log


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _out(tmp_path: Path) -> str:
    path = tmp_path / "job.out"
    return path.read_text()[-4000:] if path.exists() else "(no job.out)"
