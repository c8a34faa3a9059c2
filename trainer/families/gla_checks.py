"""The GLA family's start-up self-check: fla's Triton kernels against their torch references on the GPU.

On an H100 with triton 3.6 the kit saw GLA's LoRA gradients 25% away from fla's fp32 recurrence in a model-level
check (issue 14: TF32 inside chunk_gla, amplified by 24 layers; docs/families.md), so before a run trains on
``fla-triton``, each kernel the model will call runs one tiny forward
and backward at the model's head sizes, in the run's compute dtype, and its output and every input gradient
are compared with the reference in fp32 on the same rounded inputs (trainer/kernelcheck.py):

- ``chunk_gla`` (the layer's op on rows over 64 tokens), in both forms training calls it
  (``gla.model_inputs``): two documents through ``cu_seqlens`` as packed training rows are, each over one
  64-token chunk, so the state passed between chunks and the varlen boundary are both exercised; and
  (``chunk_gla_rows``) two rows of one document each, fla's fixed-length variant, which rows holding one
  document each take (they can replay from CUDA graphs). Against ``naive_gla`` (fla's
  ``naive_recurrent_gla``). The two variants' autotune keys differ (every tensor argument's dtype is part
  of one), so each is tuned and checked on its own: the kit ships tuned configurations for both
  (``fla_tuning``), without which a fresh H100 once spent over three minutes autotuning the second one
  at start-up (bench/RESULTS.md, issue 30).
- ``fused_recurrent_gla`` (what the layer calls on rows of 64 tokens or fewer): the same, shorter;
- fla's fused ``RMSNorm`` (with the residual add the blocks use) and ``FusedRMSNormGated`` (the output
  norm and swish gate), when ``fuse_norm`` is on; fla's fused ``swiglu_linear`` when ``fuse_swiglu`` is
  (full fine-tuning): against the torch versions the reference path swaps in.

Each check looks its kernel up where the model finds it (``fla.ops.gla``, ``fla.modules``) when it runs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from trainer.families.gla_reference import naive_gla, torch_rms_norm
from trainer.kernelcheck import compare, random_leaves

CHUNK_TOKENS = (90, 70)  # two documents, each longer than chunk_gla's 64-token chunk
ROW_TOKENS = (90, 90)  # two rows of one document each (fla's fixed-length variant)
RECURRENT_TOKENS = (40, 24)  # rows of 64 tokens or fewer go through fused_recurrent_gla
NORM_TOKENS = 48
GATE_NORMALIZER = 16  # fla's gate_logit_normalizer: gates are logsigmoid(x) / 16


def head_sizes(hf_config) -> tuple[int, int, int]:
    """(heads, key size, value size) of the model's GLA layers."""
    heads = hf_config.num_heads
    key = round(hf_config.hidden_size * hf_config.expand_k) // heads
    value = round(hf_config.hidden_size * hf_config.expand_v) // heads
    return heads, key, value


def check_gla_op(
    device, dtype, op_name: str, heads: int, key: int, value: int, tokens=CHUNK_TOKENS, varlen: bool = True
) -> float:
    """One fla GLA op, called as ``fla.layers.gla`` calls it (state_v_first), against naive_gla: packed
    documents through ``cu_seqlens`` (``varlen``), or ``len(tokens)`` rows of ``tokens[0]`` tokens each."""
    import fla.ops.gla as ops

    if varlen:
        rows, length = 1, sum(tokens)
        bounds = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    else:
        rows, length, bounds = len(tokens), tokens[0], None
    q, k, v = random_leaves(
        (rows, length, heads, key), (rows, length, heads, key), (rows, length, heads, value), device=device,
        dtype=dtype, scale=1.0,
    )  # fmt: skip
    gate = (F.logsigmoid(torch.randn(rows, length, heads, key, device=device)) / GATE_NORMALIZER).to(dtype)
    gate.requires_grad_(True)
    gate_keyword = "gk" if op_name == "fused_recurrent_gla" else "g"

    def call(op, q, k, v, gate):
        return op(q=q, k=k, v=v, **{gate_keyword: gate}, state_v_first=True, cu_seqlens=bounds)[0]

    out = call(getattr(ops, op_name), q, k, v, gate)
    return compare(out, lambda *leaves: call(naive_gla, *leaves), [q, k, v, gate])


def _norm_weight(size: int, device, dtype) -> torch.Tensor:
    weight = (1 + 0.1 * torch.randn(size, device=device)).to(dtype)
    return weight.requires_grad_(True)


def check_rms_norm(device, dtype, hidden: int, eps: float = 1e-6) -> float:
    """fla's fused RMSNorm as the GLA blocks call it (residual add, prenorm: the normed and the summed
    hidden states), against the torch version the reference path uses."""
    from fla.modules import RMSNorm

    norm = RMSNorm(hidden, eps=eps).to(device)
    x, residual = random_leaves(
        (1, NORM_TOKENS, hidden), (1, NORM_TOKENS, hidden), device=device, dtype=dtype, scale=1.0
    )
    weight = _norm_weight(hidden, device, dtype)

    def fused(x, residual, weight):
        return torch.cat(torch.func.functional_call(norm, {"weight": weight}, (x, residual, True)), -1)

    def reference(x, residual, weight):
        plain = SimpleNamespace(weight=weight, bias=None, eps=eps)
        return torch.cat(torch_rms_norm(plain, x, residual, prenorm=True), -1)

    return compare(fused(x, residual, weight), reference, [x, residual, weight])


def check_rms_norm_gated(device, dtype, heads: int, value: int, eps: float = 1e-6) -> float:
    """fla's FusedRMSNormGated (the GLA layer's output norm times swish of the output gate)."""
    from fla.modules import FusedRMSNormGated

    norm = FusedRMSNormGated(value, eps=eps).to(device)
    x, gate = random_leaves(
        (1, NORM_TOKENS, heads, value), (1, NORM_TOKENS, heads, value), device=device, dtype=dtype, scale=1.0
    )
    weight = _norm_weight(value, device, dtype)

    def fused(x, gate, weight):
        return torch.func.functional_call(norm, {"weight": weight}, (x, gate))

    def reference(x, gate, weight):
        y = torch_rms_norm(SimpleNamespace(weight=weight, bias=None, eps=eps), x)
        return y.float() * F.silu(gate.float())

    return compare(fused(x, gate, weight), reference, [x, gate, weight])


def check_swiglu_linear(device, dtype, hidden: int, intermediate: int) -> float:
    """fla's fused SwiGLU and down projection (GatedMLP with ``fuse_swiglu``)."""
    from fla.modules.activations import swiglu_linear

    gate, up, weight = random_leaves(
        (1, NORM_TOKENS, intermediate), (1, NORM_TOKENS, intermediate), (hidden, intermediate),
        device=device, dtype=dtype, scale=1.0,
    )  # fmt: skip
    out = swiglu_linear(gate, up, weight, None)
    return compare(out, lambda gate, up, weight: F.linear(F.silu(gate) * up, weight), [gate, up, weight])


def checks(hf_config) -> dict:
    """The checks for the kernels this model config will run on the ``fla-triton`` path."""
    heads, key, value = head_sizes(hf_config)
    found = {}
    if getattr(hf_config, "attn_mode", "chunk") == "chunk":
        found["chunk_gla"] = functools.partial(
            check_gla_op, op_name="chunk_gla", heads=heads, key=key, value=value
        )
        found["chunk_gla_rows"] = functools.partial(
            check_gla_op,
            op_name="chunk_gla",
            heads=heads,
            key=key,
            value=value,
            tokens=ROW_TOKENS,
            varlen=False,
        )
    found["fused_recurrent_gla"] = functools.partial(
        check_gla_op,
        op_name="fused_recurrent_gla",
        heads=heads,
        key=key,
        value=value,
        tokens=RECURRENT_TOKENS,
    )
    if getattr(hf_config, "fuse_norm", True):
        eps = getattr(hf_config, "norm_eps", 1e-6)
        found["rms_norm"] = functools.partial(check_rms_norm, hidden=hf_config.hidden_size, eps=eps)
        if (
            getattr(hf_config, "use_output_gate", True)
            and getattr(hf_config, "hidden_act", "swish") == "swish"
        ):
            found["fused_rms_norm_gated"] = functools.partial(
                check_rms_norm_gated, heads=heads, value=value, eps=eps
            )
    if getattr(hf_config, "fuse_swiglu", False) and getattr(hf_config, "hidden_act", "swish") == "swish":
        intermediate = getattr(hf_config, "intermediate_size", None) or 2 * hf_config.hidden_size
        found["swiglu_linear"] = functools.partial(
            check_swiglu_linear, hidden=hf_config.hidden_size, intermediate=intermediate
        )
    return found
