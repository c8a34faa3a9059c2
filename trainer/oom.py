"""Out-of-memory fallback: shrink the step's shape, keep the effective batch, replay the same rows.

The usual cure (halve the batch, restart) silently changes the effective batch and loses time.
Here an OOM in a training step halves the micro-batch and doubles accumulation, so the optimizer
step covers exactly the same rows; at micro-batch 1 the rows are split into shorter pieces
(25% shorter each time) instead of dropping data.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections import Counter
from dataclasses import dataclass

import torch

from trainer.data import Sequence

MIN_SPLIT_LENGTH = 16
INJECT_ENV = "KIT_TEST_INJECT_OOM"  # tests: "train:3,eval:4" raises an OOM once at those steps


class OutOfMemoryAfterRetries(RuntimeError):
    """The fallback ran out of room to shrink or out of retries."""


@dataclass(frozen=True)
class StepShape:
    """How one optimizer step's rows are fed: micro-batch size, accumulation, optional row split length."""

    micro: int
    accum: int
    split_length: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shrink(shape: StepShape, max_length: int) -> StepShape | None:
    """The next smaller shape with the same rows per step, or None when nothing is left to shrink."""
    if shape.micro > 1:
        return StepShape(shape.micro // 2, shape.accum * 2, shape.split_length)
    current = shape.split_length or max_length
    shorter = int(current * 0.75)
    if shorter < MIN_SPLIT_LENGTH:
        return None
    return StepShape(shape.micro, shape.accum, shorter)


def split_rows(rows: list[Sequence], length: int | None) -> list[Sequence]:
    """Cut each row into pieces of at most ``length`` tokens; every token stays in some piece."""
    if length is None:
        return rows
    pieces = []
    for row in rows:
        for start in range(0, len(row.input_ids), length):
            end = start + length
            pieces.append(
                Sequence(row.input_ids[start:end], row.labels[start:end], row.position_ids[start:end])
            )
    return pieces


class OomInjector:
    """Raises a fake CUDA OOM at chosen (phase, step) pairs, so the fallback can be tested on a CPU.

    A pair listed twice fires twice (the first retry of that step fails too)."""

    def __init__(self, spec: str | None = None):
        spec = spec if spec is not None else os.environ.get(INJECT_ENV, "")
        self.pending: Counter = Counter()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            phase, step = item.split(":")
            self.pending[(phase, int(step))] += 1

    def check(self, phase: str, step: int) -> None:
        if self.pending[(phase, step)] > 0:
            self.pending[(phase, step)] -= 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected for testing at {phase} step {step})")
