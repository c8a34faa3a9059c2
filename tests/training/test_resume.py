"""Exact resume after SIGKILL, a crash during a checkpoint save, and SIGTERM/SIGINT preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.faults import run_with_faults
from tests.helpers import REPO, run_trainer, start_trainer, wait_for
from trainer import runfolder
from trainer.runfolder import iter_records, last_per_step


def losses(run):
    recs = last_per_step(list(iter_records(run / "logs" / runfolder.TRAINING_LOG)))
    return {r["step"]: r["loss"] for r in recs}


def events(run):
    return list(iter_records(run / "logs" / runfolder.EVENTS_LOG))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run to compare against."""
    import yaml

    from tests.helpers import TINY

    tmp = tmp_path_factory.mktemp("reference")
    cfg = {**TINY, "paths": {**TINY["paths"], "output_dir": str(tmp / "run")}}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    result = run_trainer("train", "--config", str(tmp / "c.yaml"))
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(tmp / "run")


def assert_same_losses(run, reference):
    resumed = losses(run)
    assert sorted(resumed) == sorted(reference), "a step is missing from the logs"
    for step, loss in reference.items():
        assert abs(resumed[step] - loss) < 1e-6, (step, resumed[step], loss)


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_is_exact(write_config, tmp_path, reference):
    config = write_config()
    run = tmp_path / "run"
    proc = start_trainer("train", "--config", str(config))
    # Kill as soon as checkpoint-8 is complete: steps after it are lost and must be replayed identically.
    assert wait_for(lambda: (run / "checkpoint-8" / "trainer_state.json").exists() or proc.poll() is not None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run / "run.json").read_text())["status"] == "running"  # nobody could say otherwise
    result = run_trainer("train", "--config", str(config))  # no flag: resumes by itself
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming from" in result.stdout
    assert_same_losses(run, reference)
    resume = [e for e in events(run) if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] in (8, 12)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["resumes"] == 1


@pytest.mark.slow
def test_crash_during_save_leaves_no_checkpoint_that_resume_would_take(write_config, tmp_path, reference):
    config = write_config()
    run = tmp_path / "run"
    crashed = run_with_faults(
        "train", "--config", str(config), crash_during_save="checkpoint-8", cwd=tmp_path
    )
    assert crashed.returncode == 137
    assert (run / ".tmp-checkpoint-8").is_dir() and not (run / "checkpoint-8").exists()
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()
    resumed = run_trainer("train", "--config", str(config), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {run / 'checkpoint-4'}" in resumed.stdout
    assert not (run / ".tmp-checkpoint-8").exists()
    assert_same_losses(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_a_checkpoint_and_exits_cleanly(write_config, tmp_path, signum, code, reference):
    config = write_config({"training": {"save_steps": 100}})
    run = tmp_path / "run"
    proc = start_trainer("train", "--config", str(config))
    assert wait_for(lambda: len(losses(run)) >= 3 or proc.poll() is not None)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, output[-2000:]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted"
    saved = [e for e in events(run) if e["event"] == "checkpoint_saved"]
    assert saved and saved[-1]["kind"] == "signal" and saved[-1]["step"] == info["step"]
    assert (run / f"checkpoint-{info['step']}" / "adapter_model.safetensors").is_file()
    assert any(e["event"] == "signal" and e["signal"] == signal.Signals(signum).name for e in events(run))
    resumed = run_trainer("train", "--config", str(config))
    assert resumed.returncode == 0
    # save_steps differs from the reference, but the data order and updates do not depend on it.
    assert_same_losses(run, reference)


@pytest.mark.slow
def test_resume_from_wrong_path_is_a_clear_error(write_config, tmp_path):
    config = write_config()
    result = run_trainer("train", "--config", str(config), "--resume_from", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert f"--resume_from: path not found: {tmp_path / 'nope'}" in result.stderr
    empty = run_trainer("train", "--config", str(config), "--resume")
    assert empty.returncode == 2 and "--resume: no complete checkpoint in" in empty.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoint-4")


@pytest.mark.slow
def test_sigterm_during_a_long_evaluation_saves_its_step_and_resumes_exactly(write_config, tmp_path):
    """Preemption in the middle of an evaluation of thousands of rows: the evaluation stops within a batch,
    the step is saved with its evaluation pending, the run exits 143 well inside a scheduler's 30 s grace,
    and the resume evaluates that step again before training on, with the losses of an uninterrupted run."""
    long_eval = {
        "training": {"max_steps": 10, "save_steps": 100},
        # One row a batch over a third of the data: long enough that the signal lands inside it on an idle
        # machine too (about 300 forward passes).
        "data": {"val_fraction": 0.3},
        "eval": {"interval": 6, "at_end": False, "max_batches": 0, "batch_size": 1},
    }
    reference = write_config(
        {**long_eval, "eval": {**long_eval["eval"], "max_batches": 1}}, "ref.yaml", "ref"
    )
    result = run_trainer("train", "--config", str(reference))
    assert result.returncode == 0, result.stderr[-2000:]
    config, run = write_config(long_eval), tmp_path / "run"
    proc = start_trainer("train", "--config", str(config))
    started = lambda: any(e["event"] == "eval_start" for e in events(run))  # noqa: E731
    assert wait_for(
        lambda: (run / "logs" / runfolder.EVENTS_LOG).exists() and started() or proc.poll() is not None
    )
    time.sleep(0.5)  # well into the evaluation
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-2000:]
    assert time.monotonic() - sent < 30
    names = [(e["event"], e["step"]) for e in events(run)]
    assert ("eval_start", 6) in names and ("eval_done", 6) not in names  # it was cut, not finished
    assert names[-3:] == [("signal", 6), ("checkpoint_saved", 6), ("run_end", 6)]
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["eval_pending"] is True and state["metric_value"] is None
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"

    resumed = run_trainer("train", "--config", str(config))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_losses(run, losses(tmp_path / "ref"))
    evals = list(iter_records(run / "logs" / runfolder.EVAL_LOG))
    assert [r["step"] for r in evals] == [6]  # the evaluation the signal cut, done on resume
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["eval_pending"] is False and state["metric_value"] == pytest.approx(evals[0]["eval_loss"])
    saved = [e["kind"] for e in events(run) if e["event"] == "checkpoint_saved" and e["step"] == 6]
    assert saved == ["signal", "signal"]  # at the signal, then again with its evaluation


@pytest.mark.slow
def test_sigterm_to_one_rank_mid_evaluation_stops_every_rank_at_the_same_batch(write_config, tmp_path):
    """Two CPU ranks; only rank 1 (which writes no logs) gets SIGTERM, in the middle of a long evaluation. Rank 0
    learns of it through the per-batch agreement: both leave the evaluation at the same batch (a rank that
    left alone would hang the other in its next collective), save one checkpoint of the step, and exit."""
    import psutil

    from tests.training.test_fsdp import two_process_command, two_process_env

    config = write_config(
        {
            "training": {"max_steps": 10, "save_steps": 100},
            # A long evaluation (one row a batch, a third of the data), so the signal lands inside it on a
            # busy machine too: ~100 forward passes a rank.
            "data": {"val_fraction": 0.3},
            "eval": {"interval": 6, "at_end": False, "max_batches": 0, "batch_size": 1},
        }
    )
    run = tmp_path / "run"
    proc = subprocess.Popen(
        two_process_command(config), cwd=REPO, env=two_process_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    started = lambda: any(e["event"] == "eval_start" for e in events(run))  # noqa: E731
    assert wait_for(
        lambda: (run / "logs" / runfolder.EVENTS_LOG).exists() and started() or proc.poll() is not None
    )
    time.sleep(0.5)
    ranks = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children(recursive=True)}
    ranks["1"].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.wait(timeout=120)
    assert time.monotonic() - sent < 30
    names = [(e["event"], e["step"]) for e in events(run)]
    assert ("eval_start", 6) in names and ("eval_done", 6) not in names
    assert [n for n in names if n[0] in ("signal", "checkpoint_saved")] == [
        ("signal", 6),
        ("checkpoint_saved", 6),
    ]
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["eval_pending"] is True and state["processes"] == 2
