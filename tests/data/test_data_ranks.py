"""Two processes on one node share one data cache: one builds it, the other waits and reuses it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_trainer, trainer_env
from trainer.data import cache


def launch_two(config) -> subprocess.CompletedProcess:
    """``accelerate launch`` with two CPU processes (gloo), as a user starts a two-GPU run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**trainer_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
           "-m", "trainer", "train", "--config", str(config)]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def losses(run) -> dict[int, float]:
    lines = (run / "logs" / "training_log.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def data_report(run) -> dict:
    lines = (run / "logs" / "events.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["event"] == "data_report")


@pytest.mark.slow
def test_two_processes_tokenize_once_and_train_as_one_with_accumulation(write_config, tmp_path):
    """Rank r's micro-batch is slice r of the step, as accumulation step r of one process: same losses."""
    store = tmp_path / "cache"
    shape = {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 3, "save_steps": 3}
    extra = {
        "data": {"cache_dir": str(store)},
        "lora": {"dropout": 0.0},
        "eval": {"interval": 100, "at_end": False},
    }
    two = write_config({**extra, "training": shape}, "two.yaml", "two")
    result = launch_two(two)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert output.count("data: preparing") == 1  # one process built it; the other waited and reused it
    built = cache.entries(store)
    assert len(built) == 1
    assert data_report(tmp_path / "two")["fingerprint"] == built[0]["fingerprint"]

    one = write_config({**extra, "training": {**shape, "gradient_accumulation_steps": 2}}, "one.yaml", "one")
    single = run_trainer("train", "--config", str(one))
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    assert "data: preparing" not in single.stdout  # a new run folder, the same data: reused
    report = data_report(tmp_path / "one")
    assert report["cache_hit"] is True and report["fingerprint"] == built[0]["fingerprint"]
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5)
