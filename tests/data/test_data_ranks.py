"""Two processes on one node share one data cache: one builds it, the other waits and reuses it."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_trainer
from tests.training.test_fsdp import launch_two  # two CPU ranks (gloo), accumulation 2
from trainer.data import cache


def losses(run) -> dict[int, float]:
    lines = (run / "logs" / "training_log.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def data_report(run) -> dict:
    lines = (run / "logs" / "events.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["event"] == "data_report")


@pytest.mark.slow
def test_two_processes_tokenize_once_and_train_as_one_with_accumulation(write_config, tmp_path):
    """Two ranks with accumulation 2 take the step's slices 0, 2 (rank 0) and 1, 3 (rank 1); one process with
    accumulation 4 takes 0-3: the same rows and the same token-normalised loss."""
    store = tmp_path / "cache"
    shape = {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 3, "save_steps": 3}
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

    one = write_config({**extra, "training": {**shape, "gradient_accumulation_steps": 4}}, "one.yaml", "one")
    single = run_trainer("train", "--config", str(one))
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    assert "data: preparing" not in single.stdout  # a new run folder, the same data: reused
    report = data_report(tmp_path / "one")
    assert report["cache_hit"] is True and report["fingerprint"] == built[0]["fingerprint"]
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5)
