"""One optimizer step: which rows it takes, how they are fed, the loss of a micro-batch, accumulation.

The loss is normalised by the target tokens of the whole accumulated batch across micro-batches
and ranks, so micro-batch 4 x accumulation 4 gives the gradients of one batch of 16 even when
lengths differ.

Where a fast path plugs in: ``choose_kernels`` returns the ``StepKernels`` of a run once, at set-up:
how the loaded model is prepared and how one micro-batch's summed loss is computed. Today it
returns ``reference_kernels`` (transformers' forward plus full or chunked cross-entropy, which CPU
keeps); a CUDA path (fused kernels, fused LoRA autograd, fused linear cross-entropy instead of
``chunked_loss``) returns its own ``StepKernels`` there, and neither ``accumulate_gradients`` nor
``train()`` changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from trainer.data import batches as host_batches
from trainer.data.batches import (  # noqa: F401 - the step's rows; tests and the loop import them from here
    Position,
    StepShape,
    count_targets,
    micro_batches,
    next_step_rows,
    pin_batch,
    split_rows,
)
from trainer.data.rows import IGNORE, Sequence
from trainer.families.base import unmask_right_padding
from trainer.model import chunked_loss
from trainer.model.packed_documents import documents_known
from trainer.training import fsdp

# ---------------------------------------------------------------- the loss of one micro-batch


def to_device(inputs: dict, device: torch.device) -> dict:
    """The batch's tensors on ``device`` without waiting for the GPU: a blocking copy would stall the host until
    the previous step's optimizer kernels finish, time it could spend launching this step's forward."""
    return {k: host_batches.to_device(v, device) for k, v in inputs.items()}


class LossFn(Protocol):
    def __call__(self, model, batch: dict, accelerator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Summed next-token cross-entropy of one micro-batch, and the router aux loss (None without one).

        ``accelerator`` needs ``device`` and ``autocast()`` only."""


@dataclass(frozen=True)
class FullCrossEntropy:
    """The model's forward, then cross-entropy over all of its fp32 logits."""

    model_inputs: Callable[[dict], dict]  # the family's: a collated batch -> the forward's keyword arguments

    def __call__(self, model, batch: dict, accelerator):
        host_inputs = self.model_inputs(batch)
        inputs = to_device(host_inputs, accelerator.device)
        with accelerator.autocast(), documents_known(host_inputs):
            out = model(**inputs, use_cache=False)
        # A family may flatten packed rows into one (GLA's varlen cu_seqlens): back to the batch's shape.
        logits = out.logits.reshape(*batch["labels"].shape, -1)[:, :-1].float()
        labels = batch["labels"][:, 1:].to(logits.device)
        ce_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        return ce_sum, getattr(out, "aux_loss", None)


@dataclass(frozen=True)
class HeadLoss:
    """The output head bypassed in the forward, then ``head_loss(head, hidden, labels)`` on the final hidden
    states, so the full fp32 logits never exist: ``chunked_loss.chunked_cross_entropy`` (memory.chunked_loss,
    trainer/model/chunked_loss.py) or the CUDA fast path's fused linear cross-entropy (trainer/fastpath)."""

    model_inputs: Callable[[dict], dict]
    head_loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = (
        chunked_loss.chunked_cross_entropy
    )

    def __call__(self, model, batch: dict, accelerator):
        host_inputs = self.model_inputs(batch)
        inputs = to_device(host_inputs, accelerator.device)
        head = chunked_loss.output_head(model)
        with accelerator.autocast():
            with chunked_loss.head_bypassed(head) as seen, documents_known(host_inputs):
                out = model(**inputs, use_cache=False)
            # The head's own input, not accelerate's fp32 copy of it (dropped with ``out``: nothing reads it).
            hidden = (out.logits if seen.hidden is None else seen.hidden).reshape(*batch["labels"].shape, -1)
            aux_loss = getattr(out, "aux_loss", None)
            del out, seen
            ce_sum = self.head_loss(head, hidden, batch["labels"])
        return ce_sum, aux_loss


def _as_loaded(model):
    return model


@dataclass(frozen=True)
class StepKernels:
    """The two things a fast path replaces, picked once per run.

    ``prepare`` turns the loaded model into the one that trains (before ``accelerator.prepare``);
    ``loss`` computes one micro-batch's summed loss with it."""

    name: str
    loss: LossFn
    prepare: Callable[[torch.nn.Module], torch.nn.Module] = _as_loaded


def step_inputs(model, family) -> Callable[[dict], dict]:
    """The family's ``model_inputs``; where the decoder stack replays from CUDA graphs, after
    ``unmask_right_padding``, so that a batch with a short row replays too. A model whose forward computes a
    router aux loss keeps the mask, which leaves padding out of it."""
    from trainer import fastpath
    from trainer.fastpath.stack_graphs import StackGraphs

    routed = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    if routed or not isinstance(fastpath.layer_graphs_of(model), StackGraphs):
        return family.model_inputs
    return lambda batch: family.model_inputs(unmask_right_padding(batch))


def reference_kernels(model, family) -> StepKernels:
    """transformers' forward with the family's inputs; chunked cross-entropy where model loading enabled it."""
    inputs = step_inputs(model, family)
    if chunked_loss.enabled(model):
        return StepKernels("reference-chunked-ce", HeadLoss(inputs))
    return StepKernels("reference", FullCrossEntropy(inputs))


def kernels_for(model, family) -> StepKernels:
    """The CUDA fast path's loss where loading put it on the model (trainer/fastpath), else the reference."""
    from trainer import fastpath

    if fastpath.enabled(model):
        return StepKernels("fast-path", HeadLoss(step_inputs(model, family), fastpath.fused_loss_of(model)))
    return reference_kernels(model, family)


def choose_kernels(loaded, cfg, device: torch.device) -> StepKernels:
    """The run's kernels, from what was loaded (``loading.LoadedModel``), the config and the device.

    ``loading.load_for_training`` already decided the fast path (``performance.fast_path``, CUDA, family),
    since QLoRA's preparation differs on it; everything else is the reference."""
    return kernels_for(loaded.model, loaded.family)


def forward_loss(model, batch: dict, accelerator):
    """The loss for a model alone (tests, benchmarks): its family found from its own type."""
    from trainer.families import family_for

    config = getattr(chunked_loss.unwrap(model), "config", None)
    family = family_for(getattr(config, "model_type", "") or "")
    return kernels_for(model, family).loss(model, batch, accelerator)


# ---------------------------------------------------------------- accumulation


@dataclass
class StepResult:
    """What one step's forward and backward passes leave for the update and the log."""

    targets: torch.Tensor  # target tokens of the whole step, all ranks: the loss's denominator
    target_count: int | None  # the same number on the host in one process (several: read with the loss)
    loss_sum: torch.Tensor  # this rank's summed cross-entropy
    aux_total: torch.Tensor  # this rank's router aux loss, averaged over micro-batches
    has_aux: bool  # the model returns a router aux loss
    input_tokens: int  # this rank's non-padding input tokens


@dataclass
class Step:
    """One optimizer step's forward and backward passes: rows -> this rank's micro-batches -> gradients."""

    model: torch.nn.Module
    accelerator: object
    loss: LossFn  # the run's StepKernels.loss
    counter: object  # experts.ExpertCounter: told where each micro-batch's real tokens are
    aux_coef: float  # the model's router_aux_loss_coef (0 when it has none)
    data: list[Sequence]  # the training rows
    pad_id: int
    defer_grad_sync: bool = False  # keep gradients local (the OOM fallback of several processes syncs them)
    prefetched: tuple | None = None  # (rows, shape, batches) of the next step, built while the GPU worked

    def __call__(self, rows: list[int], shape: StepShape) -> StepResult:
        ready, self.prefetched = self.prefetched, None
        if ready is not None and ready[0] == rows and ready[1] == shape:
            return self.accumulate(ready[2])
        return self.accumulate(self.batches(rows, shape))

    def batches(self, rows: list[int], shape: StepShape) -> list[dict]:
        """This rank's micro-batches of a step, collated on the host (pinned where they go to a GPU)."""
        accelerator = self.accelerator
        batches = micro_batches(
            rows, self.data, shape, accelerator.num_processes, accelerator.process_index, self.pad_id
        )
        return [pin_batch(b, accelerator.device) for b in batches]

    def prefetch(self, rows: list[int], shape: StepShape) -> None:
        """Build the next step's micro-batches now, while the GPU still runs this one (the loop calls it before
        its sync); the next call with the same rows and shape takes them, any other call builds its own."""
        self.prefetched = (rows, shape, self.batches(rows, shape))

    def accumulate(self, batches: list[dict]) -> StepResult:
        """Gradients of the step's loss, normalised by all of its target tokens."""
        accelerator = self.accelerator
        world = accelerator.num_processes
        local_count = sum(count_targets(b) for b in batches)
        # Filled on the device: a tensor built on the host would be one more copy, and a blocking one.
        local_targets = torch.full((), float(local_count), device=accelerator.device)
        global_targets = accelerator.reduce(local_targets, "sum").clamp(min=1.0)
        target_count = local_count if world == 1 else None  # read with the loss (step_counts.py), not now
        ce_total = torch.zeros((), device=accelerator.device)
        aux_total = torch.zeros((), device=accelerator.device)
        input_tokens = sum(int(b["token_mask"].sum()) for b in batches)
        aux = None
        # FSDP reduce-scatters every micro-batch's gradients: skipping that (no_sync) would hold each rank's
        # whole unsharded gradients through the accumulation, undoing the sharding full fine-tuning needs.
        sharded = fsdp.active(accelerator)
        for k, batch in enumerate(batches):
            sync = sharded or (k == len(batches) - 1 and not self.defer_grad_sync)
            with contextlib.nullcontext() if sync else accelerator.no_sync(self.model):
                self.counter.start_micro_batch(batch["token_mask"])
                ce_sum, aux = self.loss(self.model, batch, accelerator)
                # DDP averages gradients over ranks, hence x world; dividing by all target tokens
                # of the step makes every token count the same whatever micro-batch it sits in.
                loss = ce_sum * world / global_targets
                if aux is not None and self.aux_coef:
                    loss = loss + self.aux_coef * aux / len(batches)
                    aux_total += aux.detach() / len(batches)
                accelerator.backward(loss)
            ce_total += ce_sum.detach()
        return StepResult(global_targets, target_count, ce_total, aux_total, aux is not None, input_tokens)
