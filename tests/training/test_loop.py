"""The loop's arithmetic: token-normalised accumulation, schedulers, non-finite skips, fatal errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.faults import InjectedFaults
from tests.helpers import REPO, run_trainer
from trainer import runfolder
from trainer.config import load_config
from trainer.runfolder import iter_records
from trainer.training.loop import train


def training_records(run):
    return list(iter_records(run / "logs" / runfolder.TRAINING_LOG))


@pytest.mark.slow
def test_accumulation_equals_one_big_batch_with_uneven_lengths(write_config, tmp_path):
    """Instruction records of different lengths, no packing: 4 x accumulation 4 must match 16 x 1."""
    common = {
        "paths": {"train_file": str(REPO / "data" / "tiny_instructions.jsonl")},
        "data": {"packing": False, "max_length": 64},
        "training": {"max_steps": 3, "save_steps": 100},
        "lora": {"dropout": 0.0},
        "eval": {"interval": 100, "at_end": False},
    }
    small = write_config(
        {
            **common,
            "training": {**common["training"], "micro_batch_size": 4, "gradient_accumulation_steps": 4},
        },
        "a.yaml",
        "a",
    )
    big = write_config(
        {
            **common,
            "training": {**common["training"], "micro_batch_size": 16, "gradient_accumulation_steps": 1},
        },
        "b.yaml",
        "b",
    )
    for config in (small, big):
        result = run_trainer("train", "--config", str(config))
        assert result.returncode == 0, result.stderr[-2000:]
    a, b = training_records(tmp_path / "a"), training_records(tmp_path / "b")
    for ra, rb in zip(a, b):
        assert ra["tokens"] == rb["tokens"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


@pytest.mark.parametrize(
    "name, warmup, expect",
    [
        ("constant", {"warmup_steps": 2}, [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", {"warmup_steps": 2}, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
        ("cosine", {"warmup_ratio": 0.2}, [0.0, 1.0, 0.9330, 0.75, 0.5, 0.25]),
        ("polynomial", {"warmup_steps": 2, "polynomial_power": 2.0}, [0.0, 0.5, 1.0, 0.5625, 0.25, 0.0625]),
    ],
)
def test_schedulers_with_warmup(name, warmup, expect):
    from trainer.training.optim import make_scheduler

    overrides = [f"optimization.lr_scheduler={name}", "optimization.learning_rate=1.0"]
    overrides += [f"optimization.{k}={v}" for k, v in warmup.items()]
    cfg = load_config(REPO / "training_config.yaml", overrides)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    total = 6 if name != "cosine" else 5
    scheduler = make_scheduler(optimizer, cfg, total)
    seen = []
    for _ in range(len(expect)):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    if name == "cosine":  # 5 steps, 1 of warmup: half-cosine over the other 4
        expect = [0.0] + [0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(0, 5)]
    assert seen == pytest.approx(expect[: len(seen)], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("on_device", [False, True])
def test_nonfinite_loss_is_skipped_and_logged_as_null(write_config, tmp_path, monkeypatch, on_device):
    """A NaN loss at step 3 must not update the weights; the record carries null plus a flag. Also where the
    fused AdamW (CUDA's, forced here on the CPU) skips the step on the device before the host reads the loss."""
    if on_device:
        force_fused_adamw(monkeypatch)
    cfg = load_config(write_config({"training": {"max_steps": 5, "save_steps": 100}}))
    calls = {"n": 0}

    def poisoned(real_loss):
        def loss(model, batch, accelerator):
            calls["n"] += 1
            ce_sum, aux = real_loss(model, batch, accelerator)
            if calls["n"] in (5, 6):  # both micro-batches of step 3 (accumulation 2)
                ce_sum = ce_sum * float("nan")
            return ce_sum, aux

        return loss

    assert train(cfg, faults=InjectedFaults(wrap_loss=poisoned)) == 0
    run = tmp_path / "run"
    records = training_records(run)
    step3 = records[2]
    assert step3["loss"] is None and "loss" in step3["nonfinite"] and step3["skipped"] is True
    assert all(r["loss"] is not None for r in records if r["step"] != 3)
    skipped = [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == "step_skipped"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(3, "nonfinite_loss")]
    assert "NaN" not in (run / "logs" / runfolder.TRAINING_LOG).read_text()
    assert not any(r.get("skipped") for r in records if r["step"] != 3)


def force_fused_adamw(monkeypatch):
    """The fused AdamW that CUDA runs build, which skips a non-finite step on the device, forced on the CPU."""
    from trainer.training import optim

    build = optim._build
    monkeypatch.setattr(optim, "_build", lambda groups, kwargs, name, on_cuda, fused: build(
        groups, kwargs, name, on_cuda, True))  # fmt: skip


@pytest.mark.slow
def test_each_steps_figures_are_read_after_the_next_steps_passes_are_queued(write_config, monkeypatch):
    """Where the device skips non-finite steps (fused AdamW, forced on the CPU), each step's batches are built while
    the step before's update is still queued, and a step's figures are read only once the next step's passes are
    queued: the GPU goes from one step to the next without waiting for the host. The last step, and a step that
    is evaluated or checkpointed, is read at once. Every step takes the batches built for it."""
    from trainer.training.figures import Figures
    from trainer.training.step import Step

    force_fused_adamw(monkeypatch)
    order, taken = [], []
    batches, call, accumulate, read = Step.batches, Step.__call__, Step.accumulate, Figures.read
    monkeypatch.setattr(Step, "batches", lambda self, rows, shape: order.append("build") or batches(
        self, rows, shape))  # fmt: skip
    monkeypatch.setattr(Step, "__call__", lambda self, rows, shape: taken.append(
        self.prefetched is not None and self.prefetched[0] == rows) or call(self, rows, shape))  # fmt: skip
    monkeypatch.setattr(Step, "accumulate", lambda self, b: order.append("passes") or accumulate(self, b))
    monkeypatch.setattr(
        Figures, "read", lambda self: (order.append("read") if self.pending else None) or read(self)
    )
    cfg = load_config(
        write_config({"training": {"max_steps": 5, "save_steps": 3}, "eval": {"interval": 100}})
    )
    assert train(cfg) == 0
    assert order == [
        "build", "passes", "build",  # step 1, and step 2's batches while its update is queued
        "passes", "read", "build",  # step 2's passes queued, then step 1's figures
        "passes", "read", "build", "read",  # step 2's figures; step 3 is checkpointed: read at once
        "passes", "build",  # step 4: left to read
        "passes", "read", "read",  # step 5's passes, step 4's figures, then the last step's
    ]  # fmt: skip
    assert taken == [False, True, True, True, True]  # steps 2-5 took what was built during the step before


@pytest.mark.slow
def test_figures_read_late_log_what_figures_read_at_once_log(write_config, tmp_path, monkeypatch):
    """The same run, its figures read at once (the multi-tensor AdamW: the host decides) and a step late (fused
    AdamW): the same records, loss for loss, and the same step times' meaning (positive, one per step)."""
    overrides = {"training": {"max_steps": 6, "save_steps": 4}, "eval": {"interval": 100}}
    cfg = load_config(write_config(overrides, "a.yaml", "at_once"))
    assert train(cfg) == 0
    force_fused_adamw(monkeypatch)
    cfg = load_config(write_config(overrides, "b.yaml", "late"))
    assert train(cfg) == 0
    at_once, late = training_records(tmp_path / "at_once"), training_records(tmp_path / "late")
    assert [r["step"] for r in late] == [r["step"] for r in at_once] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(at_once, late):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert (b["lr"], b["epoch"], b["tokens"]) == (a["lr"], a["epoch"], a["tokens"])
        assert b["tokens_per_sec"] > 0 and b["steps_per_sec"] > 0
    end = [
        e for e in iter_records(tmp_path / "late" / "logs" / runfolder.EVENTS_LOG) if e["event"] == "run_end"
    ]
    assert end[-1]["final_loss"] == pytest.approx(late[-1]["loss"])


@pytest.mark.slow
def test_a_signal_after_a_step_left_to_read_late_records_it_before_its_checkpoint(
    write_config, tmp_path, monkeypatch
):
    """SIGTERM during step 3, whose figures would be read after step 4's passes: the loop reads them before it
    saves, so step 3's record, the signal and the checkpoint of step 3 are all there, in that order."""
    import os
    import signal

    force_fused_adamw(monkeypatch)
    cfg = load_config(
        write_config({"training": {"max_steps": 6, "save_steps": 100}, "eval": {"interval": 100}})
    )
    calls = {"n": 0}

    def signalling(real_loss):
        def loss(model, batch, accelerator):
            calls["n"] += 1
            if calls["n"] == 5:  # step 3's first micro-batch
                os.kill(os.getpid(), signal.SIGTERM)
            return real_loss(model, batch, accelerator)

        return loss

    assert train(cfg, faults=InjectedFaults(wrap_loss=signalling)) == 143
    run = tmp_path / "run"
    records = training_records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    events = list(iter_records(run / "logs" / runfolder.EVENTS_LOG))
    names = [(e["event"], e.get("step")) for e in events]
    assert names.index(("signal", 3)) < names.index(("checkpoint_saved", 3))
    saved = events[names.index(("checkpoint_saved", 3))]
    assert records[-1]["ts"] <= saved["ts"]  # written before the save, not at the run's end
    assert (run / "checkpoint-3").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("late", [False, True])
def test_fatal_error_is_logged_then_raised(write_config, tmp_path, monkeypatch, late):
    """Also where step 2's figures were left to read late: its record is written before the error is."""
    if late:
        force_fused_adamw(monkeypatch)
    cfg = load_config(write_config({"training": {"max_steps": 5, "save_steps": 100}}))
    calls = {"n": 0}

    def exploding_at_step_3(real_loss):
        def exploding(model, batch, accelerator):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("boom at the third step")
            return real_loss(model, batch, accelerator)

        return exploding

    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, faults=InjectedFaults(wrap_loss=exploding_at_step_3))
    run = tmp_path / "run"
    errors = list(iter_records(run / "logs" / runfolder.ERROR_LOG))
    assert len(errors) == 1
    assert errors[0]["type"] == "RuntimeError" and errors[0]["message"] == "boom at the third step"
    assert errors[0]["step"] == 2 and "exploding" in errors[0]["traceback"]
    assert [r["step"] for r in training_records(run)] == [1, 2]
    info = json.loads((run / runfolder.RUN_JSON).read_text())
    assert info["status"] == "failed" and info["ended_at"]


@pytest.mark.slow
def test_step_kernels_chosen_once_drive_training_and_evaluation(write_config, tmp_path, monkeypatch):
    """The fast-path seam: kernels picked at set-up prepare the model and compute every micro-batch's
    loss, in training and in evaluation, without train() knowing which kernels they are."""
    import trainer.training.loop as loop
    from trainer.training.step import StepKernels, choose_kernels

    seen = {"choose": 0, "prepare": 0, "loss": 0}

    def counting_kernels(loaded, cfg, device):
        seen["choose"] += 1
        reference = choose_kernels(loaded, cfg, device)

        def prepare(model):
            seen["prepare"] += 1
            return reference.prepare(model)

        def loss(model, batch, accelerator):
            seen["loss"] += 1
            return reference.loss(model, batch, accelerator)

        return StepKernels("counting", loss, prepare)

    monkeypatch.setattr(loop, "choose_kernels", counting_kernels)
    cfg = load_config(
        write_config({"training": {"max_steps": 2, "save_steps": 100}, "eval": {"interval": 100}})
    )
    assert train(cfg) == 0
    evaluations = list(iter_records(tmp_path / "run" / "logs" / runfolder.EVAL_LOG))
    assert [e["step"] for e in evaluations] == [2]  # eval.at_end, over eval.max_batches=2 batches
    assert seen == {"choose": 1, "prepare": 1, "loss": 2 * 2 + 2}  # 2 steps x accumulation 2, then eval


def test_setup_objects_are_frozen_out_of_the_gc_while_training_and_released_after(write_config):
    """Python's cyclic GC must not walk the model and data at every collection during the steps, and a process
    that trains again (tests, sweeps) gets this run's objects back to collect."""
    import gc

    cfg = load_config(write_config({"training": {"max_steps": 2, "save_steps": 100}}))
    frozen_during_steps = []

    def watching(real_loss):
        def loss(model, batch, accelerator):
            frozen_during_steps.append(gc.get_freeze_count())
            return real_loss(model, batch, accelerator)

        return loss

    assert train(cfg, faults=InjectedFaults(wrap_loss=watching)) == 0
    assert frozen_during_steps and min(frozen_during_steps) > 10_000  # the model, its modules, the data rows
    assert gc.get_freeze_count() == 0
