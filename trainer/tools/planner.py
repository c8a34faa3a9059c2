"""Batch planner: dry-run a few steps per candidate shape, keep those inside the memory margin, pick the fastest.

Candidates keep the configured effective batch (micro-batch x accumulation) and try each of the
given sequence lengths; a candidate that runs out of memory, or peaks above
``(1 - margin) x device memory``, is rejected. Throughput is measured after one warm-up step.
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


def plan(
    cfg: Config,
    lengths: list[int],
    steps: int = 2,
    margin: float = 0.1,
    memory_limit_mb: float | None = None,
    faults: Faults = NO_FAULTS,
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
    for candidate in candidates:
        measure(model, optimizer, candidate, steps, accelerator, vocab, kernels.loss, faults)
        if candidate.status == "ok" and candidate.peak_mb > limit:
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
