"""OOM fallback, tested on a CPU by injecting CUDA out-of-memory errors at chosen steps."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.faults import run_with_faults
from trainer import runfolder
from trainer.data.dataset import Sequence
from trainer.runfolder import iter_records, last_per_step
from trainer.training.oom_retry import shrink
from trainer.training.step import StepShape, split_rows

FIXED = {"lora": {"dropout": 0.0}, "training": {"max_steps": 6, "save_steps": 3}, "eval": {"interval": 3}}


def train_with(config, inject: str = "") -> subprocess.CompletedProcess:
    return run_with_faults("train", "--config", str(config), oom=inject)


def merged(base: dict, training: dict) -> dict:
    return {**base, "training": {**base["training"], **training}}


def losses(run):
    return {
        r["step"]: r["loss"] for r in last_per_step(list(iter_records(run / "logs" / runfolder.TRAINING_LOG)))
    }


def events(run, name):
    return [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == name]


@pytest.mark.slow
def test_oom_halves_micro_batch_keeps_effective_batch_and_replays_the_step(write_config, tmp_path):
    injected = write_config(
        merged(FIXED, {"micro_batch_size": 4, "gradient_accumulation_steps": 2}), "a.yaml", "a"
    )
    small = write_config(
        merged(FIXED, {"micro_batch_size": 2, "gradient_accumulation_steps": 4}), "b.yaml", "b"
    )
    result = train_with(injected, "train:1,eval:3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_with(small).returncode == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == list(range(1, 7))  # no step skipped, none repeated
    for step in range(1, 7):  # the failed step is replayed on the same rows: identical to starting small
        assert a[step] == pytest.approx(b[step], abs=1e-6)
    fallbacks = events(tmp_path / "a", "oom_fallback")
    train_fb = [e for e in fallbacks if e.get("phase") != "eval"]
    assert train_fb[0]["step"] == 1
    assert train_fb[0]["old"] == {"micro": 4, "accum": 2, "split_length": None}
    assert train_fb[0]["new"] == {"micro": 2, "accum": 4, "split_length": None}
    eval_fb = [e for e in fallbacks if e.get("phase") == "eval"]
    assert eval_fb[0]["old"] == {"eval_batch_size": 8} and eval_fb[0]["new"] == {"eval_batch_size": 4}
    assert [e["step"] for e in iter_records(tmp_path / "a" / "logs" / runfolder.EVAL_LOG)] == [3, 6]
    state = json.loads((tmp_path / "a" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step_shape"] == {"micro": 2, "accum": 4, "split_length": None}


@pytest.mark.slow
def test_micro_batch_one_splits_rows_instead_of_dropping(write_config, tmp_path):
    config = write_config(merged(FIXED, {"micro_batch_size": 1, "gradient_accumulation_steps": 2}))
    result = train_with(config, "train:2")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    fallback = events(run, "oom_fallback")[0]
    assert fallback["new"] == {"micro": 1, "accum": 2, "split_length": 48}
    records = {r["step"]: r for r in iter_records(run / "logs" / runfolder.TRAINING_LOG)}
    assert sorted(records) == list(range(1, 7))
    assert all(records[s]["loss"] is not None for s in records)


@pytest.mark.slow
def test_bounded_retries_then_clear_failure_with_checkpoint(write_config, tmp_path):
    config = write_config({**FIXED, "memory": {"max_oom_retries": 1}})
    failed = train_with(config, "train:5,train:5")  # step 5 fails, and its one allowed retry fails too
    assert failed.returncode == 1
    assert "out of memory at step 5 with micro_batch_size=2" in failed.stderr
    run = tmp_path / "run"
    assert [e["new"]["micro"] for e in events(run, "oom_fallback")] == [2]
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()
    saved = events(run, "checkpoint_saved")
    assert saved[-1]["kind"] == "oom" and saved[-1]["step"] == 4
    errors = list(iter_records(run / "logs" / runfolder.ERROR_LOG))
    assert errors[-1]["type"] == "OutOfMemoryAfterRetries" and errors[-1]["step"] == 4
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    resumed = train_with(config)  # and the run carries on from there with the smaller shape
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(losses(run)) == list(range(1, 7))


def test_shrink_and_split_units():
    assert shrink(StepShape(4, 2), 64) == StepShape(2, 4)
    assert shrink(StepShape(1, 8), 64) == StepShape(1, 8, 48)
    assert shrink(StepShape(1, 8, 20), 64) is None  # 15 would be under the 16-token floor
    row = Sequence(list(range(10)), list(range(10)), list(range(10)))
    pieces = split_rows([row], 4)
    assert [p.input_ids for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sum(len(p.labels) for p in pieces) == 10


def launch_two_ranks(config, inject: str = "") -> subprocess.CompletedProcess:
    """Two processes on CPUs (gloo) under ``accelerate launch``, with faults injected per rank."""
    import socket
    import sys

    from tests.helpers import REPO, trainer_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**trainer_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
           "-m", "tests.faulty_trainer", "--oom", inject, "train", "--config", str(config)]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_oom_on_one_rank_makes_every_rank_shrink_and_replay_the_step(write_config, tmp_path):
    """Rank 1 runs out of memory at step 2: both ranks agree in one collective, redo step 2 on the same rows
    in the smaller shape and go on; losses equal a run whose gradients DDP itself averaged."""
    shape = {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 4, "save_steps": 2}
    extra = {"lora": {"dropout": 0.0}, "training": shape, "eval": {"interval": 100, "at_end": False}}
    injected = write_config(extra, "a.yaml", "a")
    reference = write_config({**extra, "memory": {"oom_fallback": False}}, "b.yaml", "b")
    result = launch_two_ranks(injected, "train:2@1")
    assert result.returncode == 0, result.stderr[-3000:]
    plain = launch_two_ranks(reference)
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == [1, 2, 3, 4]
    for step in a:  # the manual gradient average equals DDP's, and the replayed step the same rows' loss
        assert a[step] == pytest.approx(b[step], abs=1e-5)
    fallback = events(tmp_path / "a", "oom_fallback")
    assert [(e["step"], e["new"]) for e in fallback] == [(2, {"micro": 2, "accum": 2, "split_length": None})]
    assert json.loads((tmp_path / "a" / "run.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_oom_on_one_rank_without_the_fallback_fails_every_rank_with_the_message(write_config, tmp_path):
    extra = {"lora": {"dropout": 0.0}, "training": {"max_steps": 3}, "memory": {"max_oom_retries": 0}}
    result = launch_two_ranks(write_config(extra), "train:2@0")
    assert result.returncode != 0
    assert "out of memory on one of the ranks at step 2" in result.stderr


def test_oom_demo_has_rows_for_every_process(tmp_path):
    """bench/oom_demo_gpu.py --processes N: the corpus N times over, so micro-batch 64 on two ranks is not
    refused for too few rows before any OOM can happen."""
    import importlib.util

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("oom_demo_gpu", REPO / "bench" / "oom_demo_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = (REPO / "data" / "tiny_corpus.jsonl").read_text().splitlines()
    assert module.corpus(tmp_path, 1) == REPO / "data" / "tiny_corpus.jsonl"
    assert module.corpus(tmp_path, 2).read_text().splitlines() == shipped * 2


def test_the_oom_message_names_the_checkpoint_that_holds_the_run():
    """Only a checkpoint every rank saved together is named as the last completed step; otherwise the
    message points at the latest periodic one, and under FSDP says the ranks are not coordinated."""
    from tests.helpers import REPO
    from trainer.config import load_config
    from trainer.training.oom_retry import oom_failure

    ddp = load_config(REPO / "training_config.yaml", ["training.save_steps=50"])
    sharded = load_config(
        REPO / "training_config.yaml", ["training.save_steps=50", "training.distributed=fsdp"]
    )
    shape = StepShape(2, 4)
    assert "checkpoint-6 holds the last completed step" in str(oom_failure(6, shape, ddp, 1))
    assert "on one of the ranks at step 7" in str(oom_failure(6, shape, ddp, 2, coordinated=True))
    assert "no step had completed" in str(oom_failure(0, shape, ddp, 1))
    message = str(oom_failure(6, shape, sharded, 2))
    assert "out of memory (under FSDP the fallback does not coordinate the ranks) at step 7" in message
    assert "checkpoint-6" not in message
    assert "the latest checkpoint (one every training.save_steps=50) holds the run; --resume" in message


@pytest.mark.slow
def test_oom_under_fsdp_fails_with_the_message_and_the_run_resumes_from_its_checkpoint(
    write_config, tmp_path
):
    """A rank out of memory under FSDP (no coordinated fallback): the run stops with the message on every
    rank, the periodic checkpoint before it is intact, and --resume finishes the run from there."""
    extra = {
        "lora": {"dropout": 0.0},
        "training": {"distributed": "fsdp", "max_steps": 4, "save_steps": 2},
        "eval": {"interval": 100, "at_end": False},
    }
    config = write_config(extra)
    result = launch_two_ranks(config, "train:3@1")
    assert result.returncode != 0
    assert "under FSDP the fallback does not coordinate the ranks) at step 3" in result.stderr
    run = tmp_path / "run"
    assert (run / "checkpoint-2" / "training_state" / "optimizer_0" / "__1_0.distcp").is_file()
    resumed = launch_two_ranks(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run / 'checkpoint-2'}" in resumed.stdout
    assert sorted(losses(run)) == [1, 2, 3, 4]
