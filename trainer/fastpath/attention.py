"""Which attention kernel the fast path runs for packed rows, and switching a loaded model to it.

A packed row holds several documents. transformers 5 turns its restarting ``position_ids`` into a
block-diagonal causal mask (``trainer/families/base.py`` ``causal_inputs`` says when), and what that mask
costs depends on the kernel that receives it:

- ``sdpa`` gets it as a dense (batch, 1, T, T) boolean tensor: no flash kernel (that needs ``is_causal``
  and no mask), and every block of the T x T scores is computed, also those between documents;
- ``flex_attention`` (``torch.nn.attention.flex_attention``) gets a ``BlockMask`` and skips the blocks that
  lie wholly between documents: with ~250-token documents in 2048-token rows, most of them
  (``block_density`` says how many are left for a given batch).

FlexAttention has no backward on CPU (torch raises). On the GPU it was measured no faster than sdpa for
2048-token packed rows (``choose`` gives the figures), so the kit keeps sdpa unless the config names
another kernel; ``block_density`` and the per-document tests stay for anyone who does.
``bench/bench_packing_gpu.py`` measures both on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SDPA = "sdpa"
FLEX = "flex_attention"
FLEX_BLOCK = 128  # FlexAttention's default sparse block size (torch's _DEFAULT_SPARSE_BLOCK_SIZE)


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str
    reason: str

    def as_dict(self) -> dict:
        return {"attention": self.implementation, "attention_reason": self.reason}


def flex_unavailable_reason(device: torch.device) -> str | None:
    """Why FlexAttention cannot train here (None when it can)."""
    if device.type != "cuda":
        return "FlexAttention has no backward on CPU"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention (needs 2.5 or later)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "FlexAttention's CUDA kernels need triton"
    return None


def choose(device: torch.device, packing: bool, configured: str | None = None) -> AttentionChoice:
    """The attention for a run: the configured one if any, else sdpa.

    FlexAttention is not chosen by itself. Measured on the H100 (bench/bench_packing_gpu.py, Llama-1B
    shape, LoRA + checkpointing, log-normal documents packed into 2048-token rows): 35,262 real tokens/s
    against sdpa's 36,424 with its dense block-diagonal mask, since attention is a tenth of such a step;
    and a run whose batches alternate between packed and plain rows recompiled its kernels mid-run.
    ``model.attn_implementation: flex_attention`` still takes it (longer rows are where it should pay)."""
    if configured:
        return AttentionChoice(configured, "model.attn_implementation")
    if packing and flex_unavailable_reason(device) is None:
        return AttentionChoice(SDPA, "packed rows: sdpa measured as fast as FlexAttention at this length")
    return AttentionChoice(SDPA, "sdpa's kernels (FlexAttention only when configured)")


def pretrained(model):
    """The transformers model inside DDP and PEFT wrappers (the one whose config picks the attention)."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def current(model) -> str | None:
    return getattr(pretrained(model).config, "_attn_implementation", None)


def use(model, implementation: str) -> str:
    """Switch a loaded (possibly PEFT-wrapped) model to ``implementation``; returns the one now set.

    transformers' ``set_attn_implementation`` changes the config the attention layers read at every
    call, so LoRA modules, checkpointing and the fast path's patches stay as they are."""
    base = pretrained(model)
    if current(base) != implementation:
        base.set_attn_implementation(implementation)
    return current(base)


def apply(model, device: torch.device, packing: bool, configured: str | None = None) -> dict:
    """Choose and switch; the dict goes into the model report (``attention``, ``attention_reason``)."""
    choice = choose(device, packing, configured)
    now = use(model, choice.implementation)
    return AttentionChoice(now, choice.reason).as_dict()


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its document within the row: a new one wherever positions do not go up
    by one (the rule of transformers' ``find_packed_sequence_indices``)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def block_density(position_ids: torch.Tensor, block: int = FLEX_BLOCK) -> float:
    """Fraction of (query block, key block) pairs the document causal mask leaves to compute, over all
    pairs of the batch: what FlexAttention computes, where sdpa with a dense mask computes all of them.

    Document ids grow along a row, so a key block at or before a query block shares a document with it
    exactly when its last document is at least the query block's first."""
    docs = document_ids(position_ids)
    rows, length = docs.shape
    pad = (-length) % block
    if pad:  # a partial last block holds the row's last documents
        docs = torch.cat([docs, docs[:, -1:].expand(rows, pad)], dim=1)
    blocks = docs.reshape(rows, -1, block)
    first, last = blocks[..., 0], blocks[..., -1]
    count = blocks.shape[1]
    causal = torch.ones(count, count, dtype=torch.bool).tril()
    needed = (last[:, None, :] >= first[:, :, None]) & causal  # [row, query block, key block]
    return float(needed.sum()) / (rows * count * count)
