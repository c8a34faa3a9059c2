"""The output head of a causal LM, as the losses see it: which models' logits are exactly ``lm_head(hidden)``,
the head itself, and running the model with the head bypassed so its ``.logits`` are the hidden states.

Shared by the reference path's chunked cross-entropy (trainer/model/chunked_loss.py) and the CUDA fast
path's fused linear cross-entropy (trainer/fastpath), which both run the head themselves.
"""

from __future__ import annotations

import contextlib
import types

import torch

# model_type -> logits are lm_head(final hidden state), nothing applied after.
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "olmoe",
        "phi3", "deepseek_v3",
        # transformers' Mamba heads cast the hidden states to the head's dtype first (the losses do the same);
        # fla's GLA head, without labels, is the plain projection
        "mamba", "mamba2", "gla",
    }
)  # fmt: skip


def supports_chunked_loss(model) -> bool:
    """True when the model's logits are exactly its head applied to the last hidden state."""
    config = getattr(unwrap(model), "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES


def unwrap(model):
    return getattr(model, "module", model)


def output_head(model) -> torch.nn.Module:
    """The module that maps hidden states to logits (a LoRA-wrapped Linear when LoRA targets lm_head)."""
    return unwrap(model).get_output_embeddings()


@contextlib.contextmanager
def head_bypassed(head: torch.nn.Module):
    """During the model's forward the head returns its input, so ``.logits`` holds the hidden states.

    Yields a namespace whose ``hidden`` is the tensor the head was handed, in the model's own dtype: under
    mixed precision accelerate converts the forward's outputs to fp32, a copy of twice the size that the loss
    would otherwise take and slice (bench/memory_peak.py: 192 MiB of fp32 copies live beside the fused
    loss of Llama-1B at 4 x 2048)."""
    seen = types.SimpleNamespace(hidden=None)

    def bypass(hidden, *args, **kwargs):
        seen.hidden = hidden
        return hidden

    previous = head.__dict__.get("forward")  # an accelerate hook may already wrap it
    head.forward = bypass
    try:
        yield seen
    finally:
        if previous is not None:
            head.forward = previous
        else:
            del head.forward  # back to the class's forward
