"""`sweep --backend slurm` without a cluster: the batch script, submission and resubmission against a fake
sbatch/squeue/sacct, `sweep status`, the options' errors, the SLURM ids a run records, slurm_task.sh's
signal handling and slurm_train.sh's rendezvous mapping. tests/slurm/test_slurm_cluster.py does it for real.
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

from tests.helpers import REPO, TINY, deep_merge, wait_for
from trainer.cli import main
from trainer.runfolder import slurm_job, slurm_row
from trainer.sweep import slurm
from trainer.sweep.jobs import SweepError
from trainer.sweep.spec import load_sweep

# sbatch/squeue/sacct stand-ins: each call is appended to calls.jsonl; answers come from files beside them.
FAKE = r"""#!{python}
import json, os, sys
from pathlib import Path
here = Path(__file__).parent
name = Path(sys.argv[0]).name
with open(here / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"cmd": name, "args": sys.argv[1:]}}) + "\n")
if name == "sbatch":
    n = int((here / "next_id").read_text()) if (here / "next_id").exists() else 4242
    (here / "next_id").write_text(str(n + 1))
    print(n)
else:
    answer = here / f"{{name}}.out"
    print(answer.read_text() if answer.exists() else "", end="")
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A folder of fake SLURM commands first on PATH; returns it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "sacct", "scontrol"):
        path = bin_dir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def calls(bin_dir: Path, cmd: str) -> list[list[str]]:
    path = bin_dir / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [c["args"] for c in map(json.loads, lines) if c["cmd"] == cmd]


@pytest.fixture
def sweep_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(deep_merge(TINY, {"paths": {"output_dir": str(tmp_path / "unused")}})))
    spec = {
        "name": "grid",
        "output_root": str(tmp_path / "runs"),
        "configs": {"tiny": str(base)},
        "grid": {"lora.r": [4, 8]},
        "seeds": [1, 2],
        "slurm": {"partition": "gpu", "time": "04:00:00", "gpus_per_job": 1, "max_parallel": 2,
                  "setup": ["module load cuda"], "sbatch_args": ["--constraint=a100"]},
    }  # fmt: skip
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def finish(job_dir: Path, **run_json) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "run.json").write_text(json.dumps({"status": "finished", **run_json}))


def test_dry_run_prints_an_array_script_of_the_unfinished_jobs(sweep_file, tmp_path, capsys):
    finish(tmp_path / "runs" / "tiny_r4_seed2")
    code = main(["sweep", str(sweep_file), "--backend", "slurm", "--dry-run", "--time", "1-00:00:00"])
    out = capsys.readouterr().out
    assert code == 0
    assert "4 jobs, 1 finished, 0 queued or running already, 3 to submit" in out
    lines = out.splitlines()
    directives = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH")]
    assert directives == [
        "--job-name=sweep-grid",
        "--array=0,2,3%2",  # index 1 (tiny_r4_seed2) is finished
        "--nodes=1",
        "--ntasks=1",
        "--requeue",
        "--signal=B:USR1@300",
        "--open-mode=append",
        f"--output={tmp_path / 'runs' / 'slurm' / '%A_%a.out'}",
        "--partition=gpu",
        "--time=1-00:00:00",  # the flag wins over the file
        "--gres=gpu:1",
        "--constraint=a100",
    ]
    assert "module load cuda" in lines
    branch = lines.index("  2)  # tiny_r8_seed1")
    assert lines[branch + 1] == f"    job_dir={tmp_path / 'runs' / 'tiny_r8_seed1'}"
    command = lines[branch + 2]
    assert command.startswith(f"    command=({REPO / 'launch_training.sh'} --max_restarts 1 --config ")
    assert "--set lora.r=8 --set training.seed=1" in command
    assert command.endswith(f"--set paths.output_dir={tmp_path / 'runs' / 'tiny_r8_seed1'}) ;;")
    assert lines[-1] == f'exec bash {REPO / "scripts" / "slurm_task.sh"} "$job_dir" -- "${{command[@]}}"'
    assert not (tmp_path / "runs" / "slurm").exists()  # a dry run writes nothing
    script = "\n".join(lines[lines.index("#!/usr/bin/env bash") :])
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_submit_records_the_array_and_a_resubmission_skips_finished_and_queued(
    sweep_file, tmp_path, fake_slurm
):
    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 0
    (first,) = calls(fake_slurm, "sbatch")
    script = Path(first[-1])
    assert script.parent == tmp_path / "runs" / "slurm" and "#SBATCH --array=0,1,2,3%2" in script.read_text()
    summary = json.loads((tmp_path / "runs" / "sweep.json").read_text())
    assert summary["backend"] == "slurm" and summary["status"] == "submitted"
    assert summary["submissions"][0]["array_job_id"] == "4242"
    jobs = {j["name"]: j for j in summary["jobs"]}
    assert jobs["tiny_r8_seed2"]["slurm"]["id"] == "4242_3" and jobs["tiny_r8_seed2"]["state"] == "queued"

    # One job finished, one still running, one failed (gone from the queue): two go in a new array.
    finish(tmp_path / "runs" / "tiny_r4_seed1")
    (fake_slurm / "sacct.out").write_text("4242_3|FAILED|1:0\n")
    (fake_slurm / "squeue.out").write_text("4242|1|RUNNING|None\n")  # 4242_2: gone, sacct knows nothing
    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 0
    second = calls(fake_slurm, "sbatch")[-1]
    assert "#SBATCH --array=2,3%2" in Path(second[-1]).read_text()
    assert script.read_text().count("#SBATCH --array=0,1,2,3%2") == 1  # the first script is kept as it was
    summary = json.loads((tmp_path / "runs" / "sweep.json").read_text())
    jobs = {j["name"]: j for j in summary["jobs"]}
    assert jobs["tiny_r4_seed1"]["state"] == "done" and jobs["tiny_r4_seed1"]["slurm"]["id"] == "4242_0"
    assert jobs["tiny_r4_seed2"]["state"] == "running" and jobs["tiny_r4_seed2"]["slurm"]["id"] == "4242_1"
    assert jobs["tiny_r8_seed1"]["slurm"]["id"] == "4243_2"
    assert [s["array_job_id"] for s in summary["submissions"]] == ["4242", "4243"]


def test_only_keeps_the_other_jobs_records(sweep_file, tmp_path, fake_slurm):
    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 0
    assert main(["sweep", str(sweep_file), "--backend", "slurm", "--only", "*_r8_*"]) == 0
    jobs = {j["name"]: j for j in json.loads((tmp_path / "runs" / "sweep.json").read_text())["jobs"]}
    assert len(jobs) == 4
    assert (
        jobs["tiny_r4_seed1"]["slurm"]["id"] == "4242_0" and jobs["tiny_r8_seed1"]["slurm"]["id"] == "4243_2"
    )


def test_status_reads_the_queue_beside_the_run_folders(sweep_file, tmp_path, fake_slurm, capsys):
    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 0
    finish(tmp_path / "runs" / "tiny_r4_seed1", slurm={"restart_count": 0})
    running = tmp_path / "runs" / "tiny_r4_seed2"
    (running / "logs").mkdir(parents=True)
    (running / "logs" / "training_log.jsonl").write_text('{"ts": 1, "step": 5, "total_steps": 12}\n')
    (running / "run.json").write_text(json.dumps({"status": "running", "slurm": {"restart_count": 1}}))
    (fake_slurm / "squeue.out").write_text("4242|1|RUNNING|None\n4242|3|PENDING|BeginTime\n")
    (fake_slurm / "sacct.out").write_text("4242_2|CANCELLED by 0|0:15\n")
    capsys.readouterr()
    assert main(["sweep", "status", str(sweep_file)]) == 0
    out = capsys.readouterr().out
    assert "sweep grid (running): 4 jobs: 1 queued · 1 running · 1 done · 1 interrupted" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["tiny_r4_seed2"][:5] == ["tiny_r4_seed2", "running", "4242_1", "RUNNING", "2"]
    assert rows["tiny_r4_seed2"][-1] == "5/12"
    assert rows["tiny_r8_seed1"][:4] == ["tiny_r8_seed1", "interrupted", "4242_2", "CANCELLED"]
    assert rows["tiny_r8_seed2"][:4] == ["tiny_r8_seed2", "queued", "4242_3", "PENDING"]
    summary = json.loads((tmp_path / "runs" / "sweep.json").read_text())
    assert summary["status"] == "running" and summary["counts"]["running"] == 1
    job = next(j for j in summary["jobs"] if j["name"] == "tiny_r8_seed2")
    assert job["slurm"]["state"] == "PENDING" and job["slurm"]["reason"] == "BeginTime"
    assert slurm_row(json.loads((running / "run.json").read_text()), job)["attempt"] == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--slurm", "partiton=gpu"], "--slurm partiton: unknown SLURM option 'partiton' (did you mean 'partition'?)"),
        (["--time", "4h"], "--slurm time: expected a SLURM time like 90, 04:00:00 or 1-12:00:00, got '4h'"),
        (["--slurm", "gpus_per_job=two"], "--slurm gpus_per_job: expected an integer >= 0, got 'two'"),
        (["--slurm", "mem"], "--slurm 'mem': expected KEY=VALUE, e.g. partition=gpu"),
        (["--gpus", "0,1"], "--gpus/--gpu-plan: SLURM picks the GPUs; ask with --slurm gpus_per_job=N"),
    ],
)  # fmt: skip
def test_bad_slurm_options_are_one_line_and_exit_2(sweep_file, capsys, flags, message):
    assert main(["sweep", str(sweep_file), "--backend", "slurm", "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_file_section_errors_name_the_key(sweep_file):
    spec = yaml.safe_load(sweep_file.read_text())
    with pytest.raises(SweepError, match=r"^slurm.max_parallel: expected an integer >= 1, got 0$"):
        slurm.slurm_options({**spec["slurm"], "max_parallel": 0})
    with pytest.raises(SweepError, match=r"^backend: expected one of local, slurm, got 'pbs'$"):
        sweep_file.write_text(yaml.safe_dump({**spec, "backend": "pbs"}))
        load_sweep(sweep_file)


def test_no_sbatch_is_a_clear_error(sweep_file, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 2
    assert "sbatch: not found; run this on a SLURM login node" in capsys.readouterr().err


def test_backend_from_the_file(sweep_file, capsys):
    spec = yaml.safe_load(sweep_file.read_text())
    sweep_file.write_text(yaml.safe_dump({**spec, "backend": "slurm"}))
    assert main(["sweep", str(sweep_file), "--dry-run"]) == 0
    assert "#SBATCH --array=0,1,2,3%2" in capsys.readouterr().out


def test_run_records_the_slurm_job_it_ran_as():
    env = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "7", "SLURM_RESTART_COUNT": "2",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_PARTITION": "gpu"}  # fmt: skip
    info = slurm_job(env)
    assert info["id"] == "70_7" and info["job_id"] == "77" and info["restart_count"] == 2
    assert info["nodes"] == "gpu[01-02]" and info["partition"] == "gpu"
    assert (
        slurm_job({"SLURM_JOB_ID": "5"})["id"] == "5"
        and slurm_job({"SLURM_JOB_ID": "5"})["restart_count"] == 0
    )
    assert slurm_job({}) is None
    assert slurm_row({"slurm": info}) == {"id": "70_7", "state": None, "reason": None, "checked_at": None,
                                          "attempt": 3, "nodes": "gpu[01-02]"}  # fmt: skip
    assert slurm_row({}) is None


# ---------------------------------------------------------------- the shell scripts

# A trainer stand-in: on SIGTERM it takes a moment to "save", then writes run.json and exits 143.
FAKE_TRAINER = r"""
import json, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(*_):
    time.sleep(1.0)
    (out / "saved").write_text("yes")
    (out / "run.json").write_text(json.dumps({"status": "interrupted"}))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
(out / "started").write_text("yes")
time.sleep(60)
"""


def start_task(tmp_path: Path, fake_slurm: Path) -> subprocess.Popen:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (tmp_path / "trainer.py").write_text(FAKE_TRAINER)
    # The command is a shell that runs the trainer as its child, as launch_training.sh does.
    command = ["bash", "-c", f"{sys.executable} {tmp_path / 'trainer.py'} {job_dir}; exit $?"]
    env = dict(os.environ, SLURM_JOB_ID="99", SLURM_ARRAY_JOB_ID="98", SLURM_ARRAY_TASK_ID="1",
               SLURM_RESTART_COUNT="1", SWEEP_NAME="s")  # fmt: skip
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "slurm_task.sh"), str(job_dir), "--", *command], env=env
    )
    assert wait_for(lambda: (job_dir / "started").exists(), timeout=30)
    return proc


def test_slurm_task_near_the_time_limit_saves_then_requeues(tmp_path, fake_slurm):
    proc = start_task(tmp_path, fake_slurm)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 143
    assert (tmp_path / "job" / "saved").exists()  # it waited for the save
    assert calls(fake_slurm, "scontrol") == [["requeue", "99"]]
    log = (tmp_path / "job" / "job.log").read_text()
    assert log.startswith("==== sweep s: slurm job 98_1 (job id 99), attempt 2 on ")
    assert "SIGUSR1: time limit near" in log and "requeueing job 99" in log


def test_slurm_task_on_sigterm_saves_and_leaves_the_requeue_to_slurm(tmp_path, fake_slurm):
    proc = start_task(tmp_path, fake_slurm)
    proc.send_signal(signal.SIGTERM)  # only to the batch shell: it forwards to the command's group
    started = time.time()
    assert proc.wait(timeout=30) == 143
    assert time.time() - started >= 0.9 and (tmp_path / "job" / "saved").exists()
    assert calls(fake_slurm, "scontrol") == []


def test_slurm_task_usage_error():
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm_task.sh"), "dir"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "usage: slurm_task.sh JOB_DIR -- COMMAND" in result.stderr


def slurm_train(env_extra: dict, fake_bin: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PATH=f"{fake_bin}{os.pathsep}{env['PATH']}", **env_extra)
    return subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sh"), *args], env=env,
                          capture_output=True, text=True)  # fmt: skip


def test_slurm_train_maps_the_slurm_environment_to_accelerate(tmp_path, fake_slurm):
    (fake_slurm / "scontrol.out").write_text("gpu03\ngpu04\n")
    env = {"SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "123456", "SLURMD_NODENAME": "gpu04"}  # fmt: skip
    result = slurm_train(env, fake_slurm, "--print", "--config", "c.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "node gpu04: NUM_PROCESSES=8 ACCELERATE_ARGS=--num_machines 2 --machine_rank 1 --main_process_ip gpu03 "
        "--main_process_port 23456",
        f"{REPO / 'launch_training.sh'} --config c.yaml ",
    ]
    assert calls(fake_slurm, "scontrol") == [["show", "hostnames", "gpu[03-04]"]]
    port = slurm_train({**env, "MAIN_PROCESS_PORT": "29400", "GPUS_PER_NODE": "2", "ACCELERATE_ARGS": "--x"},
                       fake_slurm, "--print")  # fmt: skip
    assert "NUM_PROCESSES=4 " in port.stdout and "--main_process_port 29400 --x" in port.stdout
    two_tasks = slurm_train({**env, "SLURM_NTASKS": "8"}, fake_slurm, "--print")
    assert two_tasks.returncode == 2
    assert "expected one task per node, got 8 tasks on 2 nodes (srun --ntasks-per-node=1)" in two_tasks.stderr
    outside = slurm_train({}, fake_slurm, "--print")
    assert outside.returncode == 2 and "not inside a SLURM job: run it with srun" in outside.stderr


def test_runs_overview_shows_each_runs_slurm_job_and_state(sweep_file, tmp_path, fake_slurm):
    from dashboard import create_app

    assert main(["sweep", str(sweep_file), "--backend", "slurm"]) == 0
    job_dir = tmp_path / "runs" / "tiny_r4_seed2"
    (job_dir / "logs").mkdir(parents=True)
    ran = slurm_job({"SLURM_JOB_ID": "4246", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "1",
                     "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST": "gpu07"})  # fmt: skip
    (job_dir / "run.json").write_text(json.dumps({"status": "running", "slurm": ran}))
    (fake_slurm / "squeue.out").write_text("4242|1|RUNNING|None\n")
    assert main(["sweep", "status", str(sweep_file)]) == 0
    client = create_app(tmp_path / "runs", test_config={"TESTING": True}).test_client()
    rows = {r["name"]: r for r in client.get("/api/overview").get_json()["runs"]}
    row = rows["tiny_r4_seed2"]
    assert row["sweep"] == "grid"
    assert {k: row["slurm"][k] for k in ("id", "state", "attempt", "nodes")} == {
        "id": "4242_1", "state": "RUNNING", "attempt": 2, "nodes": "gpu07"
    }  # fmt: skip
    page = client.get("/runs").get_data(as_text=True)
    assert "SLURM 4242_1 running, attempt 2" in page


def test_status_of_a_local_sweep_and_of_one_never_started(sweep_file, tmp_path, capsys):
    assert main(["sweep", "status", str(sweep_file)]) == 2
    assert f"{tmp_path / 'runs' / 'sweep.json'}: not found; start the sweep first" in capsys.readouterr().err
    job_dir = tmp_path / "runs" / "tiny_r4_seed1"
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / "logs" / "training_log.jsonl").write_text('{"ts": 1, "step": 3, "total_steps": 12}\n')
    local = {"sweep": "grid", "status": "running", "counts": {"running": 1},
             "jobs": [{"name": "tiny_r4_seed1", "state": "running", "output_dir": str(job_dir)}]}  # fmt: skip
    (tmp_path / "runs" / "sweep.json").write_text(json.dumps(local))
    assert main(["sweep", "status", str(sweep_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "sweep grid (running): 1 jobs: 1 running"
    assert out[2].split() == ["tiny_r4_seed1", "running", "-", "-", "[##--------]", "3/12"]
    assert main(["sweep", "stats", str(sweep_file)]) == 2


def test_launchers_starting_together_install_into_a_shared_venv_once(tmp_path):
    """A job array's tasks share one .venv: the first installs what is missing, the others wait for it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\ncase "$*" in *"install -q -e"*) sleep 1 ;; esac\n'
    )
    (venv / "bin" / "python").chmod(0o755)
    setup = f". {REPO / 'scripts' / 'setup_venv.sh'}; setup_venv train"
    env = dict(os.environ, VENV_DIR=str(venv))
    both = [subprocess.Popen(["bash", "-c", setup], env=env) for _ in range(2)]
    assert [p.wait(timeout=60) for p in both] == [0, 0]
    installs = [c for c in (tmp_path / "calls").read_text().splitlines() if "install -q -e" in c]
    assert installs == [f"-m pip install -q -e {REPO}[train]"]
