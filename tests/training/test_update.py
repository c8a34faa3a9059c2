"""The update of one step (trainer/training/loop.py ``update``): clip, skip a non-finite step, step.

PyTorch's fused AdamW skips a step by itself when handed a ``found_inf`` tensor, so there the kit queues the
update before the host reads the loss and gradient norm (its one sync a step), and the GPU is not idle while
the host steps the optimizer. The CPU has the fused AdamW too: the same decision, weights and optimizer state
as the host's decision, and the sync after the step, are checked here.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers import REPO
from trainer.config import load_config
from trainer.training import loop


class Accelerator:
    """What ``update`` asks of accelerate, on one process."""

    num_processes = 1

    def reduce(self, tensor, reduction):
        return tensor

    def clip_grad_norm_(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm)


def config(*overrides):
    return load_config(REPO / "training_config.yaml", list(overrides))


def model_and_optimizer(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True if fused else None)


def one_step(model, optimizer, cfg, poison: str | None = None, order=None):
    x = torch.randn(5, 4)
    loss_sum = model(x).pow(2).sum()
    if poison == "loss":
        loss_sum = loss_sum * float("nan")
    loss_sum.backward()
    if poison == "grad":
        model.weight.grad[0, 0] = float("inf")
    result = types.SimpleNamespace(
        loss_sum=loss_sum.detach(), targets=torch.tensor(5.0), target_count=5, input_tokens=5, has_aux=False
    )
    if order is not None:
        step, read = optimizer.step, loop.read_figures
        optimizer.step = lambda *a, **k: order.append("step") or step(*a, **k)
        loop.read_figures = lambda *a: order.append("read") or read(*a)
    meanwhile = (lambda: order.append("meanwhile")) if order is not None else (lambda: None)
    try:
        figures = loop.update(Accelerator(), model, optimizer, result, cfg, meanwhile)
        if figures.pending and order is not None:
            order.append("read")  # the caller's read, which may come a step later (loop.read_late)
        return figures.read()[:3]  # loss, gradient norm, why skipped (the counts: test_step_counts.py)
    finally:
        if order is not None:
            loop.read_figures = read
        optimizer.zero_grad(set_to_none=True)


def state_of(model, optimizer):
    kept = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        kept += [v.detach().clone() for v in state.values()]
    return kept


@pytest.mark.parametrize("poison,reason", [("loss", "nonfinite_loss"), ("grad", "nonfinite_grad_norm")])
def test_a_nonfinite_step_is_skipped_on_the_device_as_the_host_skips_it(poison, reason):
    cfg = config()
    model, optimizer = model_and_optimizer(fused=True)
    assert loop.skips_on_device(optimizer, cfg) is optimizer
    one_step(model, optimizer, cfg)
    before = state_of(model, optimizer)
    loss, grad_norm, skipped = one_step(model, optimizer, cfg, poison=poison)
    assert skipped == reason and not hasattr(optimizer, "found_inf")
    assert all(
        torch.equal(a, b) for a, b in zip(before, state_of(model, optimizer))
    )  # weights, moments, step
    _, _, skipped = one_step(model, optimizer, cfg)
    assert skipped is None and not torch.equal(before[0], model.weight)  # and the next step updates


def test_the_decision_reaches_the_optimizer_as_a_0_dim_tensor(monkeypatch):
    """``found_inf`` is 0-dim whatever shape the gradient norm comes in (a 1-element one fails to broadcast
    against FSDP's sharded parameters: bench/RESULTS.md session 35)."""
    cfg = config()
    model, optimizer = model_and_optimizer(fused=True)
    norm = Accelerator.clip_grad_norm_
    monkeypatch.setattr(Accelerator, "clip_grad_norm_", lambda self, p, m: norm(self, p, m).reshape(1))
    seen, step = [], optimizer.step
    optimizer.step = lambda *a, **k: seen.append(optimizer.found_inf.clone()) or step(*a, **k)
    for poison in (None, "grad"):
        one_step(model, optimizer, cfg, poison=poison)
    assert [(f.shape, f.item()) for f in seen] == [(torch.Size([]), 0.0), (torch.Size([]), 1.0)]


def test_the_device_decision_trains_the_weights_of_the_host_decision():
    """Three steps, the second non-finite: fused AdamW skipping on the device against the multi-tensor AdamW
    whose step the host leaves out."""
    cfg = config()
    runs = []
    for fused in (True, False):
        model, optimizer = model_and_optimizer(fused)
        figures = [one_step(model, optimizer, cfg, poison=p) for p in (None, "loss", None)]
        runs.append(([f[2] for f in figures], [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0] == [None, "nonfinite_loss", None]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(runs[0][1], runs[1][1]))


def test_the_host_reads_the_figures_after_the_update_and_its_other_work_are_queued():
    """Where the device decides, ``update`` returns figures not yet read: the caller's read, the sync, comes
    after the step and ``meanwhile`` (schedule, next batches). Where the host decides, it reads first."""
    cfg = config()
    order = []
    model, optimizer = model_and_optimizer(fused=True)
    one_step(model, optimizer, cfg, order=order)
    assert order == ["step", "meanwhile", "read"]
    order.clear()
    model, optimizer = model_and_optimizer(fused=False)  # the host decides first
    one_step(model, optimizer, cfg, order=order)
    assert order == ["read", "step", "meanwhile"]
    order.clear()
    one_step(model, optimizer, cfg, poison="loss", order=order)  # a skipped step still schedules on
    assert order == ["read", "meanwhile"]


def test_fp16_keeps_the_hosts_decision():
    _, optimizer = model_and_optimizer(fused=True)
    wrapped = types.SimpleNamespace(optimizer=optimizer)  # accelerate's wrapper holds the torch optimizer
    assert loop.skips_on_device(wrapped, config()) is optimizer
    fp16 = types.SimpleNamespace(training=types.SimpleNamespace(mixed_precision="fp16", distributed="ddp"))
    assert loop.skips_on_device(wrapped, fp16) is None


@pytest.fixture
def one_gloo_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp_sharded_parameters_skip_a_nonfinite_step_on_the_device_too(one_gloo_rank):
    """FSDP's parameters are DTensors; PyTorch's fused AdamW skips their step on a 0-dim ``found_inf`` (a
    1-element one fails to broadcast there on CUDA). Three steps, the second non-finite: the step is skipped
    (weights, moments and step count kept), and the weights end as the unsharded run's."""
    from torch.distributed.fsdp import fully_shard

    cfg = config("training.distributed=fsdp")
    runs = []
    for sharded in (True, False):
        model, optimizer = model_and_optimizer(fused=True)
        if sharded:
            fully_shard(model, mesh=one_gloo_rank)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
            assert loop.skips_on_device(optimizer, cfg) is optimizer
        one_step(model, optimizer, cfg)
        before = state_of(model, optimizer)
        _, _, skipped = one_step(model, optimizer, cfg, poison="loss")
        assert skipped == "nonfinite_loss" and not hasattr(optimizer, "found_inf")
        assert all(torch.equal(a, b) for a, b in zip(before, state_of(model, optimizer)))
        _, _, skipped = one_step(model, optimizer, cfg)
        assert skipped is None
        runs.append([getattr(p, "full_tensor", p.detach)().detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*runs))
