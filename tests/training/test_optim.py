"""What a resume restores beyond the weights: a paged optimizer's state paged again (bitsandbytes' load_state_dict
brings it back unpaged), and the process count the checkpoint was written by."""

from __future__ import annotations

import types

import torch

from trainer.training import checkpointing
from trainer.training.optim import repage_state


class FakePagedOptimizer:
    """bitsandbytes' interface as repage_state uses it; ``get_state_buffer`` marks what it hands out as paged."""

    def __init__(self, is_paged: bool):
        self.is_paged = is_paged
        self.state = {}
        self.handed_out = []

    def get_state_buffer(self, p, dtype=torch.float32):
        buffer = torch.zeros(p.shape, dtype=dtype)
        buffer.is_paged = True
        self.handed_out.append(buffer)
        return buffer


def loaded_state(optimizer):
    big, small = torch.arange(200_000, dtype=torch.uint8), torch.randn(10)
    optimizer.state = {
        "lora_B": {"state1": big.clone(), "state2": big.flip(0), "qmap1": torch.randn(256), "step": 3},
        "lora_A": {"state1": small.clone()},
    }
    return big, small


def test_large_state_goes_back_to_paged_buffers_with_its_values():
    optimizer = FakePagedOptimizer(is_paged=True)
    big, small = loaded_state(optimizer)
    wrapped = types.SimpleNamespace(optimizer=optimizer)  # as accelerate hands it to the loop
    assert repage_state(wrapped) == 2
    moved = optimizer.state["lora_B"]
    assert moved["state1"].is_paged and moved["state2"].is_paged and moved["state1"].dtype == torch.uint8
    assert torch.equal(moved["state1"], big) and torch.equal(moved["state2"], big.flip(0))
    assert not hasattr(moved["qmap1"], "is_paged") and moved["step"] == 3  # not optimizer state buffers
    assert torch.equal(optimizer.state["lora_A"]["state1"], small)  # bitsandbytes pages only >= 1e5 elements
    assert repage_state(wrapped) == 0  # already paged


def test_unpaged_optimizers_are_left_alone():
    optimizer = FakePagedOptimizer(is_paged=False)
    loaded_state(optimizer)
    assert repage_state(optimizer) == 0 and optimizer.handed_out == []
    assert repage_state(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])) == 0


def test_restore_repages_the_optimizer_it_loads(monkeypatch):
    optimizer = FakePagedOptimizer(is_paged=True)
    loaded_state(optimizer)
    monkeypatch.setattr(checkpointing, "load_checkpoint_weights", lambda *a: None)
    accelerator = types.SimpleNamespace(load_state=lambda path: None, num_processes=1)
    monkeypatch.setattr(checkpointing.fsdp, "active", lambda acc: False)
    resume = types.SimpleNamespace(
        path=checkpointing.Path("/nonexistent/checkpoint-4"),
        state={"step": 4, "epoch_index": 0, "rows_seen": 8},
    )
    state = checkpointing.LoopState(shape=checkpointing.StepShape(micro=1, accum=1))
    checkpointing.restore(resume, accelerator, None, state, optimizer)
    assert state.step == 4 and len(optimizer.handed_out) == 2


def resume_point(processes):
    state = {"step": 4, "epoch_index": 0, "rows_seen": 8}
    if processes is not None:
        state["processes"] = processes
    return types.SimpleNamespace(path=checkpointing.Path("/runs/a/checkpoint-4"), state=state)


def test_a_different_process_count_is_warned_about_once(monkeypatch, capsys):
    """trainer_state.json records how many processes wrote it: another count goes on with one warning line
    (under FSDP saying the optimizer state is resharded; tests/training/test_fsdp.py resumes such runs); the
    same count, or an older checkpoint that does not say, resumes silently."""
    accelerator = types.SimpleNamespace(num_processes=1, is_main_process=True)
    for sharded, saved in ((False, 2), (False, 1), (False, None), (True, 1), (True, 4)):
        monkeypatch.setattr(checkpointing.fsdp, "active", lambda acc, on=sharded: on)
        checkpointing.check_process_count(resume_point(saved), accelerator)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
    tail = (
        ": the run goes on, but random streams differ from an uninterrupted run, and rows per step do too unless "
        "training.gradient_accumulation_steps was scaled to keep micro-batch x accumulation x processes"
    )
    assert warnings == [
        "WARNING: checkpoint-4 was saved by 2 processes and resumes on 1" + tail,
        "WARNING: checkpoint-4 was saved by 4 processes and resumes on 1 (FSDP: the optimizer state is resharded "
        "onto the new count)" + tail,
    ]


def test_a_cuda_run_builds_the_fused_adamw_while_its_model_is_still_on_the_host():
    """A model that is not quantized loads on the host, and accelerate moves it to the GPU after the optimizer is
    built: AdamW is fused all the same (the multi-tensor path reads each step count on the host, and cannot skip
    a step on the device). So does FSDP, whose sharding moves them too, but not with ``fsdp.cpu_offload``,
    where the shards stay on the host; the CPU keeps the multi-tensor path."""
    from tests.helpers import REPO
    from trainer.config import load_config
    from trainer.training.optim import fused_on, make_optimizer

    model = torch.nn.Linear(4, 3)  # on the host, as loaded
    cfg = load_config(REPO / "training_config.yaml")
    assert make_optimizer(model, cfg, on_cuda=True).defaults["fused"] is True
    assert not make_optimizer(model, cfg, on_cuda=False).defaults["fused"]
    fsdp = load_config(REPO / "training_config.yaml", ["training.distributed=fsdp"])
    assert fused_on(fsdp, on_cuda=True)
    offload = load_config(
        REPO / "training_config.yaml", ["training.distributed=fsdp", "fsdp.cpu_offload=true"]
    )
    assert not fused_on(offload, on_cuda=True)
