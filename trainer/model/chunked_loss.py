"""Chunked cross-entropy: never hold the full (tokens x vocabulary) fp32 logits.

With a 128k vocabulary, a micro-batch of 4 x 2048 tokens has 4 GiB of fp32 logits, plus their bf16
copy and gradient: that, not the weights, sets the peak of a 1B QLoRA run. Here the model's output
head is bypassed during its forward (it returns the final hidden states), and the head plus the
cross-entropy run on chunks of tokens under activation checkpointing, so only one chunk's logits
exist at a time, in the forward and again in the backward.

Only for architectures whose logits are exactly ``lm_head(hidden)`` (no soft-capping or scaling
after the head): the allow-list below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.data.rows import IGNORE
from trainer.families.head import (  # noqa: F401 - the loss's view of the model, shared with trainer/fastpath
    PLAIN_HEAD_MODEL_TYPES,
    head_bypassed,
    output_head,
    supports_chunked_loss,
    unwrap,
)

CHUNK_TOKENS = 2048

ENABLED_ATTRIBUTE = "_kit_chunked_loss"


def enable(model, wanted: bool) -> bool:
    """Mark the model (as the loop will hold it) for chunked loss when wanted and safe; returns the decision."""
    decision = bool(wanted) and supports_chunked_loss(model) and output_head(model) is not None
    setattr(unwrap(model), ENABLED_ATTRIBUTE, decision)
    return decision


def enabled(model) -> bool:
    return bool(getattr(unwrap(model), ENABLED_ATTRIBUTE, False))


def _chunk_ce(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    weight = getattr(head, "weight", None)
    if (
        weight is not None
        and weight.is_floating_point()
        and not torch.is_autocast_enabled(hidden.device.type)
    ):
        hidden = hidden.to(weight.dtype)  # a Mamba model hands its hidden states back in fp32 (``.float()``)
    logits = type(head).forward(head, hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of ``hidden`` (B x T x H) against ``labels`` (B x T), chunk by chunk."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = labels[:, 1:].reshape(-1).to(hidden.device)
    keep = labels != IGNORE  # padding and prompt tokens need no logits at all
    hidden, labels = hidden[keep], labels[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        h, y = hidden[start : start + CHUNK_TOKENS], labels[start : start + CHUNK_TOKENS]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_ce, head, h, y, use_reentrant=False)
        else:
            total = total + _chunk_ce(head, h, y)
    return total
