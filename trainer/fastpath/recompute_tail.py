"""A checkpointed decoder layer's recompute without its MLP's output projection, where nothing reads it.

Why: with checkpointing each layer runs its forward twice, and the second time (in the backward) only what
the backward saves is needed, not the layer's output. In a pre-norm decoder layer the MLP's output goes only
into the residual add that makes that output, so its down projection is computed for nothing: one GEMM of
tokens x intermediate x hidden per layer (Llama-1B at 4 x 2048: 275 GFLOP, ~0.4 ms on an H200; 16 layers,
~5% of a checkpointed step). The MLP's backward needs only what its forward saves (its input, gate and up
outputs, and the activation's LoRA-A product), none of which is the output.

Whether a layer may skip it is read, once per layer, from the autograd graph of its first recompute, which
runs whole (``learn``): every path from the layer's output to the fused MLP's node must pass only through
adds, subtractions, views and casts, whose backward reads no values (``only_summed``). A post-MLP norm,
a gate or a clamp keeps the recompute whole. Then ``skipping(layer)`` around a recompute makes
``lora_ops.LoraMLPFunction`` return zeros of the output's shape and compute nothing in its forward: its
backward runs the block, forward and backward, by blocks of rows, so the block's (tokens x intermediate)
tensors never exist whole in the backward (the peak of the CUDA graphs' pool). The gradients are the same
(tests/fastpath/test_recompute_tail.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

# Nodes whose backward hands the output's gradient on without reading any forward value.
VALUE_FREE = frozenset(
    {
        "AddBackward0",
        "SubBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ToCopyBackward0",
        "CloneBackward0",
    }
)

_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> whether its recompute may skip
_state = threading.local()  # the recompute runs on the autograd engine's thread for that device


def output_unused() -> bool:
    """Inside ``skipping`` of a layer that may skip: the fused MLP need not compute its output."""
    return getattr(_state, "skip", False)


@contextlib.contextmanager
def skipping(layer):
    """Around a layer's recompute: its MLP skips the output projection where ``learn`` found nothing reads it."""
    before = getattr(_state, "skip", False)
    _state.skip = layer is not None and _verdicts.get(layer, False)
    try:
        yield
    finally:
        _state.skip = before


def learn(layer, out: torch.Tensor) -> None:
    """Record, from ``out`` (the layer's output, recomputed whole), whether later recomputes may skip."""
    if layer is not None and layer not in _verdicts:
        _verdicts[layer] = only_summed(out)


def may_skip(layer) -> bool:
    return bool(_verdicts.get(layer, False))


def _is_mlp(node) -> bool:
    """An autograd node of a function that computes nothing for its output while ``output_unused()``
    (``lora_ops.LoraMLPFunction``: its class says so with ``SKIPS_UNUSED_OUTPUT``)."""
    return getattr(getattr(node, "_forward_cls", None), "SKIPS_UNUSED_OUTPUT", False)


def only_summed(out: torch.Tensor) -> bool:
    """Whether ``out``'s graph holds a fused MLP whose output reaches ``out`` only through value-free nodes."""
    root = out.grad_fn
    if root is None:
        return False
    into_mlp: dict = {}  # MLP node -> the nodes that take its output
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if _is_mlp(child):
                into_mlp.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    if not into_mlp:
        return False
    summed = {root} if type(root).__name__ in VALUE_FREE else set()
    stack = list(summed)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None and child not in summed and type(child).__name__ in VALUE_FREE:
                summed.add(child)
                stack.append(child)
    return all(parent in summed for parents in into_mlp.values() for parent in parents)
