"""Batch planner: dry-run a few steps per candidate shape, keep those inside the memory margin, pick the fastest.

Candidates keep the configured effective batch (micro-batch x accumulation) and try each of the
given sequence lengths; a candidate that runs out of memory, or peaks above
``(1 - margin) x device memory``, is rejected. Throughput is measured after one warm-up step.

Under FSDP (training.distributed: fsdp) across N GPUs the dry run still happens on one device, and the peak
each GPU would see is predicted from it: the parameters, gradients and optimizer state are divided by N
(each rank holds its shard), activations are not (each rank runs its own micro-batch), plus one decoder
layer gathered whole at a time (two with prefetching) and the output head, gathered whole from the loss on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from trainer.config import Config
from trainer.data.dataset import collate, pack
from trainer.training.faults import NO_FAULTS, Faults
from trainer.training.oom_retry import free_memory, is_oom
from trainer.training.step import LossFn


@dataclass
class Candidate:
    micro: int
    accum: int
    max_length: int
    tokens_per_sec: float | None = None
    peak_mb: float | None = None
    status: str = "untested"  # ok, oom, over_margin
    per_gpu_mb: float | None = None  # FSDP: the predicted peak of each of fsdp_gpus GPUs
    fsdp_gpus: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def candidate_shapes(effective: int, lengths: list[int]) -> list[Candidate]:
    """Every power-of-two micro-batch that divides the effective batch, for each length."""
    micros = [m for m in (2**i for i in range(0, int(math.log2(effective)) + 1)) if effective % m == 0]
    return [Candidate(m, effective // m, length) for length in lengths for m in sorted(micros)]


def device_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    import psutil

    return psutil.virtual_memory().total / 2**20


class PeakMemory:
    """Peak accelerator memory (CUDA) or peak resident memory (CPU) across a candidate's steps."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0.0

    def reset(self) -> None:
        self.peak = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def sample(self) -> float:
        if self.device.type == "cuda":
            value = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            import psutil

            value = psutil.Process().memory_info().rss / 2**20
        self.peak = max(self.peak, value)
        return self.peak


def synthetic_rows(vocab_size: int, rows: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (rows * length,), generator=generator).tolist()
    return pack([(ids, ids)], length, pad_id=0)


def measure(
    model, optimizer, candidate: Candidate, steps: int, accelerator, vocab: int, loss: LossFn, faults: Faults
) -> None:
    """Run ``steps`` optimizer steps of this shape with the run's loss; fills tokens/s and peak memory,
    or marks an OOM."""
    peak = PeakMemory(accelerator.device)
    rows = synthetic_rows(vocab, candidate.micro * candidate.accum, candidate.max_length)
    batches = [collate(rows[i : i + candidate.micro], 0) for i in range(0, len(rows), candidate.micro)]
    free_memory()
    peak.reset()
    try:
        timings = []
        for _ in range(steps + 1):
            started = time.perf_counter()
            for batch in batches:
                faults.oom("plan", candidate.micro)
                ce_sum, _ = loss(model, batch, accelerator)
                accelerator.backward(ce_sum / max(1, int((batch["labels"] != -100).sum())))
                peak.sample()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            timings.append(time.perf_counter() - started)
        step_time = sorted(timings[1:])[len(timings[1:]) // 2]
        candidate.tokens_per_sec = round(
            candidate.micro * candidate.accum * candidate.max_length / step_time, 1
        )
        candidate.peak_mb = round(peak.sample(), 1)
        candidate.status = "ok"
    except Exception as exc:
        optimizer.zero_grad(set_to_none=True)
        if not is_oom(exc):
            raise
        candidate.status = "oom"
        free_memory()


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)) / 2**20


@dataclass
class ShardedState:
    """What one device's dry run says about FSDP's share of its memory (MB)."""

    sharded_mb: float  # parameters, gradients and optimizer state as FSDP keeps them: each rank holds 1/N
    layer_mb: float  # the largest decoder layer's parameters, gathered whole while it runs
    head_mb: float  # the output head's parameters: gathered whole from the loss through backward's start
    held_mb: (
        float  # the same state as the dry run held it (less than sharded_mb where FSDP keeps fp32 masters)
    )


def sharded_state_mb(model, optimizer, master_fp32: bool = False) -> ShardedState:
    """FSDP's share of a dry run's memory. ``master_fp32``: accelerate keeps FSDP's trainable parameters in
    fp32 under mixed precision (and so their gradients and optimizer state), whatever dtype they trained
    in on one device: full fine-tuning in bf16 holds twice the state under FSDP, before dividing it."""
    params = list(model.parameters())
    trainable = {id(p) for p in params if p.requires_grad}

    def state(upcast: bool) -> float:
        def mb(tensor, owner) -> float:
            size = tensor.element_size()
            if upcast and id(owner) in trainable and tensor.is_floating_point():
                size = max(size, 4)
            return tensor.numel() * size / 2**20

        total = sum(mb(p, p) for p in params)
        total += sum(mb(p.grad, p) for p in params if p.grad is not None)
        return total + sum(
            mb(v, p)
            for p, per_param in optimizer.state.items()
            for v in per_param.values()
            if torch.is_tensor(v)
        )

    layers = [
        m for m in model.modules() if type(m).__name__ in set(getattr(model, "_no_split_modules", ()) or ())
    ]
    largest = max((tensor_mb(m.parameters()) for m in layers), default=0.0)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_mb = tensor_mb(head.parameters()) if head is not None else 0.0
    return ShardedState(state(master_fp32), largest, head_mb, state(False))


def fsdp_per_gpu_mb(peak_mb: float, state: ShardedState, gpus: int, prefetch: int = 1) -> float:
    """One device's measured peak, predicted for each of ``gpus`` under FSDP: the state the dry run held
    replaced by FSDP's (fp32 masters for full fine-tuning) divided by ``gpus``, activations as measured, plus
    the gathered layers: the current one and those prefetched (one at least: torch's own, fsdp.forward_prefetch
    more). The output head is not divided:
    accelerate keeps it gathered from the loss (where the peak usually is) until backward starts (a
    128k-vocabulary head of an 8B model: 1 GiB in bf16)."""
    if gpus <= 1:
        return peak_mb
    spread = 1 - 1 / gpus
    return (
        peak_mb
        - state.held_mb
        + state.sharded_mb / gpus
        + (state.head_mb + (1 + max(1, prefetch)) * state.layer_mb) * spread
    )


def plan(
    cfg: Config,
    lengths: list[int],
    steps: int = 2,
    margin: float = 0.1,
    memory_limit_mb: float | None = None,
    faults: Faults = NO_FAULTS,
    fsdp_gpus: int | None = None,
):
    """Dry-run every candidate on the real model; returns (chosen candidate or None, all candidates, limit MB)."""
    from accelerate import Accelerator

    from trainer.model.loading import load_for_training
    from trainer.training.optim import make_optimizer
    from trainer.training.step import choose_kernels

    accelerator = Accelerator(mixed_precision=cfg.training.mixed_precision)
    loaded = load_for_training(cfg, accelerator.device)
    kernels = choose_kernels(loaded, cfg, accelerator.device)
    model = kernels.prepare(loaded.model)
    model = model.to(accelerator.device) if cfg.training.method != "qlora" else model
    optimizer = make_optimizer(model, cfg, accelerator.device.type == "cuda")
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    vocab = int(accelerator.unwrap_model(model).config.vocab_size)
    limit = (memory_limit_mb or device_memory_mb(accelerator.device)) * (1 - margin)
    effective = cfg.training.micro_batch_size * cfg.training.gradient_accumulation_steps
    candidates = candidate_shapes(effective, lengths)
    gpus = fsdp_gpus if cfg.training.distributed == "fsdp" else None
    # accelerate's fsdp2_prepare_model: fp32 master weights under mixed precision, except for 4-bit models
    master_fp32 = cfg.training.mixed_precision != "no" and cfg.training.method != "qlora"
    for candidate in candidates:
        measure(model, optimizer, candidate, steps, accelerator, vocab, kernels.loss, faults)
        peak = candidate.peak_mb
        if candidate.status == "ok" and gpus:
            state = sharded_state_mb(accelerator.unwrap_model(model), optimizer, master_fp32)
            candidate.per_gpu_mb = round(fsdp_per_gpu_mb(peak, state, gpus, cfg.fsdp.forward_prefetch), 1)
            candidate.fsdp_gpus = gpus
            peak = candidate.per_gpu_mb
        if candidate.status == "ok" and peak > limit:
            candidate.status = "over_margin"
    fitting = [c for c in candidates if c.status == "ok"]
    chosen = max(fitting, key=lambda c: c.tokens_per_sec) if fitting else None
    del model, optimizer
    free_memory()
    return chosen, candidates, limit


def apply_plan(cfg: Config, chosen: Candidate) -> Config:
    training = dataclasses.replace(
        cfg.training, micro_batch_size=chosen.micro, gradient_accumulation_steps=chosen.accum
    )
    data = dataclasses.replace(cfg.data, max_length=chosen.max_length)
    return dataclasses.replace(cfg, training=training, data=data)
