"""Out-of-memory fallback: shrink the step's shape, keep the effective batch, replay the same rows.

The usual cure (halve the batch, restart) silently changes the effective batch and loses time.
Here an OOM in a training step halves the micro-batch and doubles accumulation, so the optimizer
step covers exactly the same rows; at micro-batch 1 the rows are split into shorter pieces
(25% shorter each time) instead of dropping data. Single-process training only: ranks of a
multi-process run cannot agree on a new shape mid-step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer import runfolder
from trainer.config import Config
from trainer.training.faults import Faults
from trainer.training.step import StepResult, StepShape

MIN_SPLIT_LENGTH = 16


class OutOfMemoryAfterRetries(RuntimeError):
    """The fallback ran out of room to shrink or out of retries."""


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


def oom_failure(step: int, shape: StepShape, cfg: Config, world: int) -> OutOfMemoryAfterRetries:
    """The error for an OOM the fallback cannot absorb: out of retries, of room to shrink, or multi-process."""
    return OutOfMemoryAfterRetries(
        f"out of memory at step {step + 1} with micro_batch_size={shape.micro}, "
        f"gradient_accumulation_steps={shape.accum}, split length {shape.split_length or cfg.data.max_length}"
        f"{'' if world == 1 else ' (the fallback runs in single-process training only)'}; "
        f"checkpoint-{step} holds the last completed step. Lower training.micro_batch_size or data.max_length, "
        "or enable memory.gradient_checkpointing"
    )


@dataclass
class OomFallback:
    """Runs a training step, retrying it in a smaller shape after an out-of-memory error."""

    cfg: Config
    log: runfolder.RunLog
    optimizer: object
    world: int
    is_main: bool
    faults: Faults

    def run(
        self,
        done: int,
        shape: StepShape,
        attempt: Callable[[StepShape], StepResult],
        save_before_failing: Callable[[], None],
    ) -> tuple[StepResult, StepShape]:
        """Step ``done + 1`` in ``shape``, or in the smaller shape that fits; returns the result and that shape.

        When no smaller shape is allowed, the last completed step is checkpointed (single process)
        and ``OutOfMemoryAfterRetries`` raised."""
        retries = self.cfg.memory.max_oom_retries
        for tries in range(retries + 1):
            try:
                self.faults.oom("train", done + 1)
                return attempt(shape), shape
            except Exception as exc:
                self.optimizer.zero_grad(set_to_none=True)
                if not is_oom(exc):
                    raise
                free_memory()
                smaller = shrink(shape, self.cfg.data.max_length)
                if not self.cfg.memory.oom_fallback or self.world > 1 or smaller is None or tries == retries:
                    if done > 0 and self.world == 1:
                        save_before_failing()  # keep what was trained before failing
                    raise oom_failure(done, shape, self.cfg, self.world) from exc
                self.log.event(
                    "oom_fallback",
                    step=done + 1,
                    old=shape.as_dict(),
                    new=smaller.as_dict(),
                    attempt=tries + 1,
                )
                if self.is_main:
                    print(
                        f"out of memory at step {done + 1}: now {smaller.as_dict()} (same rows per step)",
                        flush=True,
                    )
                shape = smaller
        raise AssertionError("unreachable: the last try either returns or raises")
