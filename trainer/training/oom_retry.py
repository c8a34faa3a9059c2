"""Out-of-memory fallback: shrink the step's shape, keep the effective batch, replay the same rows.

The usual cure (halve the batch, restart) silently changes the effective batch and loses time.
Here an OOM in a training step halves the micro-batch and doubles accumulation, so the optimizer
step covers exactly the same rows; at micro-batch 1 the rows are split into shorter pieces
(25% shorter each time) instead of dropping data.

Several processes: a rank that runs out of memory cannot join the others' gradient all-reduce, so
with the fallback on, gradients stay local through the step (``Step.defer_grad_sync``). After it,
one all-reduce tells every rank whether any rank failed (and which parameters have gradients
anywhere); then either all ranks redo the step in the same smaller shape, or the gradients are
averaged as DDP would have, bucket by bucket. The cost is DDP's overlap of that all-reduce with
backward: small for LoRA's gradients, so full fine-tuning keeps DDP's overlap and fails with the message.
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


def oom_failure(
    step: int, shape: StepShape, cfg: Config, world: int, coordinated: bool = False
) -> OutOfMemoryAfterRetries:
    """The error for an OOM the fallback cannot absorb: out of retries, of room to shrink, or switched off.
    It says which checkpoint holds the run: step ``step``'s when every rank could save it together (one
    process, or ranks that agreed), else the last one ``training.save_steps`` wrote."""
    if world == 1 or coordinated:
        where = "" if world == 1 else " on one of the ranks"
    elif cfg.training.distributed == "fsdp":
        where = " (under FSDP the fallback does not coordinate the ranks)"
    else:
        where = " (several processes: the fallback covers LoRA and QLoRA runs with memory.oom_fallback on)"
    if step == 0:
        kept = "no step had completed"
    elif world == 1 or coordinated:
        kept = f"checkpoint-{step} holds the last completed step"
    else:
        kept = (
            f"the latest checkpoint (one every training.save_steps={cfg.training.save_steps}) holds the run; "
            "--resume continues from it"
        )
    return OutOfMemoryAfterRetries(
        f"out of memory{where} at step {step + 1} with micro_batch_size={shape.micro}, "
        f"gradient_accumulation_steps={shape.accum}, split length {shape.split_length or cfg.data.max_length}; "
        f"{kept}. Lower training.micro_batch_size or data.max_length, or enable memory.gradient_checkpointing"
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
    model: torch.nn.Module | None = None  # several processes: the model whose gradients the fallback syncs

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
        coordinated = self.world > 1 and self.cfg.memory.oom_fallback and self.model is not None
        for tries in range(retries + 1):
            failure = result = None
            try:
                self.faults.oom("train", done + 1)
                result = attempt(shape)
            except Exception as exc:
                self.optimizer.zero_grad(set_to_none=True)
                if not is_oom(exc):
                    raise
                failure = exc
                free_memory()
            if coordinated:
                failed_anywhere = agree_and_sync(self.model, failure is not None, self.world)
            else:
                failed_anywhere = failure is not None
            if not failed_anywhere:
                return result, shape
            self.optimizer.zero_grad(set_to_none=True)
            smaller = shrink(shape, self.cfg.data.max_length)
            can_retry = self.cfg.memory.oom_fallback and (coordinated or self.world == 1)
            if not can_retry or smaller is None or tries == retries:
                if done > 0 and (self.world == 1 or coordinated):
                    save_before_failing()  # keep what was trained before failing (every rank, together)
                raise oom_failure(done, shape, self.cfg, self.world, coordinated) from failure
            self.log.event(
                "oom_fallback",
                step=done + 1,
                old=shape.as_dict(),
                new=smaller.as_dict(),
                attempt=tries + 1,
                **({"rank_failed": failure is not None} if coordinated else {}),
            )
            if self.is_main:
                print(
                    f"out of memory at step {done + 1}"
                    f"{' on a rank' if coordinated else ''}: now {smaller.as_dict()} (same rows per step)",
                    flush=True,
                )
            shape = smaller
        raise AssertionError("unreachable: the last try either returns or raises")


GRADIENT_BUCKET_BYTES = 64 * 2**20


def agree_and_sync(model, failed_here: bool, world: int) -> bool:
    """One all-reduce: did any rank run out of memory, and which parameters have a gradient on some rank.
    When none failed, gradients are averaged across ranks as DDP would (missing ones count as zeros where
    another rank has one; a parameter no rank touched keeps no gradient). Returns whether any rank failed."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    flags = torch.tensor([float(failed_here)] + [float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] > 0:
        return True
    have = [p for p, seen in zip(params, flags[1:].tolist()) if seen > 0]
    for p in have:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in gradient_buckets([p.grad for p in have]):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world)
        for grad, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(synced)
    return False


def gradient_buckets(grads: list) -> list[list]:
    """Gradients in groups of one dtype, at most ~64 MB each (one all-reduce per group)."""
    buckets, current, size = [], [], 0
    for grad in grads:
        if current and (
            grad.dtype != current[0].dtype
            or size + grad.numel() * grad.element_size() > GRADIENT_BUCKET_BYTES
        ):
            buckets.append(current)
            current, size = [], 0
        current.append(grad)
        size += grad.numel() * grad.element_size()
    if current:
        buckets.append(current)
    return buckets
