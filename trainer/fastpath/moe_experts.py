"""4-bit MoE experts on the fast path: one dequantization and one grouped GEMM per projection, not a loop.

``trainer/moe_quant.py`` keeps fused expert weights in 4-bit and leaves them on transformers' eager
experts loop, which for every expert a batch routes to dequantizes its weights, gathers its tokens, runs two
GEMMs and scatters the result: with 64 routed experts, hundreds of small launches per layer and a step bound
by host time (the scaled-down glm4_moe trained at 0.31x the tokens/s of Trainer + PEFT, whose 16-bit experts
run through ``grouped_mm``). Here each layer's experts are stored as one packed tensor, dequantized in one
launch into a buffer shared by every layer of that shape, and multiplied by ``grouped_mm`` as transformers'
own ``grouped_mm`` implementation does; backward dequantizes again instead of saving the 16-bit weights, so
they exist for one projection at a time. The cost: that transient buffer (one layer's experts in 16-bit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from trainer.fastpath.lora_ops import _dequant_buffer
from trainer.moe_quant import QuantizedExpertWeights

IMPLEMENTATION = "kit_grouped_4bit"  # the name registered in transformers' experts interface


@dataclass
class PackedExperts:
    """All experts of one 3-D weight as one packed tensor with the block scales of all of them.

    With double quantization the 8-bit scales and their fp32 second-level scales are concatenated too, so
    one ``dequantize_blockwise`` recovers every expert's scales (each expert's offset added afterwards).

    Experts stored as floating parameters (``quantization`` storage under FSDP) are not packed once: FSDP
    shards each of them and gathers them for the layer's forward and backward, so ``live`` names the module
    whose experts are concatenated at each call, as gathered then (one transient copy of the packed bytes)."""

    packed: torch.Tensor | None  # uint8, every expert's bytes in order; None: read from ``live`` at each call
    absmax: torch.Tensor  # fp32 scales, or uint8 when ``nested``
    absmax2: torch.Tensor | None  # fp32 second-level scales (nested only)
    code2: torch.Tensor | None
    offsets: torch.Tensor | None  # (experts,) fp32, each expert's scale offset (nested only)
    blocksize: int
    blocksize2: int
    quant_type: str
    shape: tuple  # (experts, out, in)
    dtype: torch.dtype
    live: QuantizedExpertWeights | None = None

    def bytes(self) -> torch.Tensor:
        """Every expert's packed bytes, in order (uint8)."""
        if self.live is None:
            return self.packed
        params = self.live._parameters
        pieces = [params[f"packed_{i}"].reshape(-1) for i in range(self.shape[0])]
        return torch.cat(pieces).view(torch.uint8)

    def scales(self) -> torch.Tensor:
        if self.absmax2 is None:
            return self.absmax
        ops = torch.ops.bitsandbytes
        scales = ops.dequantize_blockwise.default(
            self.absmax, self.absmax2, self.code2, self.blocksize2, torch.float32
        )
        scales.view(self.shape[0], -1).add_(self.offsets.unsqueeze(1))
        return scales

    def dequantize(self) -> torch.Tensor:
        """Every expert's weight in 16-bit, (experts x out x in); on CUDA into the shared buffer."""
        ops = torch.ops.bitsandbytes
        packed = self.bytes()
        args = (packed, self.scales(), self.blocksize, self.quant_type, self.shape, self.dtype)
        if packed.device.type != "cuda":
            # bitsandbytes' CPU kernel lays blocks out per row when a row is shorter than a block, so the
            # experts are dequantized one at a time there, from the same packed bytes and scales.
            experts = self.shape[0]
            packed, scales = packed.view(experts, -1), args[1].view(experts, -1)
            return torch.stack([
                ops.dequantize_4bit.default(packed[i], scales[i], *args[2:4], self.shape[1:], self.dtype)
                for i in range(experts)
            ])  # fmt: skip
        out = _dequant_buffer(self.shape, self.dtype, packed.device)
        ops.dequantize_4bit.out(*args, out=out)
        return out


def pack_experts(weights: QuantizedExpertWeights) -> PackedExperts | None:
    """One packed tensor for all experts of ``weights``. Byte buffers are packed now, each expert's own bytes
    becoming views into it (no copy kept); floating parameters (FSDP's storage) are concatenated at each call
    (``PackedExperts.live``). None where the experts are not uniform."""
    states = weights.quant_states
    pieces = [getattr(weights, f"packed_{i}") for i in range(len(weights))]
    first = states[0]
    uniform = all(
        p.dtype == pieces[0].dtype
        and s.blocksize == first.blocksize
        and s.quant_type == first.quant_type
        and s.nested == first.nested
        for p, s in zip(pieces, states, strict=True)
    )
    values = weights.shape[1] * weights.shape[2]
    if not uniform or values % first.blocksize:  # blocks must not straddle two experts
        return None
    live = pieces[0].dtype != torch.uint8
    if live:
        packed = None  # sharded by FSDP (sharded loading: still empty stand-ins here); read at each call
    else:
        packed = torch.cat([p.reshape(-1) for p in pieces])
        size = pieces[0].numel()
        for index, piece in enumerate(pieces):
            setattr(weights, f"packed_{index}", packed[index * size : (index + 1) * size].view(piece.shape))
    nested = first.nested and all(
        s.absmax.numel() % s.state2.blocksize == 0 and s.state2.blocksize == first.state2.blocksize
        for s in states
    )
    if nested:
        absmax = torch.cat([s.absmax for s in states])
        count = states[0].absmax.numel()
        for index, state in enumerate(states):  # the per-expert states see the shared scales
            state.absmax = absmax[index * count : (index + 1) * count]
        absmax2 = torch.cat([s.state2.absmax for s in states])
        offsets = torch.stack([torch.as_tensor(s.offset, dtype=torch.float32) for s in states])
        code2, blocksize2 = first.state2.code, first.state2.blocksize
    else:  # plain scales, or second-level blocks that would straddle experts: fp32 scales kept
        absmax = torch.cat([_plain_scales(s) for s in states])
        absmax2 = code2 = offsets = None
        blocksize2 = 0
    return PackedExperts(
        packed, absmax, absmax2, code2, offsets.to(absmax.device) if offsets is not None else None,
        first.blocksize, blocksize2, first.quant_type, tuple(weights.shape), first.dtype,
        weights if live else None,
    )  # fmt: skip


def _plain_scales(state) -> torch.Tensor:
    if not state.nested:
        return state.absmax.float()
    inner = state.state2
    scales = torch.ops.bitsandbytes.dequantize_blockwise.default(
        state.absmax, inner.absmax, inner.code, inner.blocksize, torch.float32
    )
    return scales + state.offset


class GroupedFrozenLinear(torch.autograd.Function):
    """``y[g] = x[g] @ W[e(g)]^T`` for token groups sorted by expert, W frozen and 4-bit.

    Only the group offsets are saved: backward dequantizes W again (into the same shared buffer), so no
    16-bit expert weight outlives the GEMM that uses it."""

    @staticmethod
    def forward(ctx, hidden, experts: PackedExperts, offsets):
        from transformers.integrations.moe import _grouped_mm

        ctx.experts = experts
        ctx.save_for_backward(offsets)
        weight = experts.dequantize()
        return _grouped_mm(hidden.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        from transformers.integrations.moe import _grouped_mm

        (offsets,) = ctx.saved_tensors
        weight = ctx.experts.dequantize()
        return _grouped_mm(grad.contiguous().to(weight.dtype), weight, offs=offsets), None, None


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm_experts_forward`` (integrations/moe.py) with the two projections through
    ``GroupedFrozenLinear``: tokens sorted by expert, one grouped GEMM per projection, weights summed in fp32."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_sorted, perm = torch.sort(expert_ids)
    grouped = hidden_states[perm // num_top_k]
    # histc, not bincount: bincount's output length depends on the data and would stall the host on CUDA.
    # histc takes integers on CUDA and floats on CPU.
    ids = expert_ids_sorted.int() if expert_ids_sorted.is_cuda else expert_ids_sorted.float()
    counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = GroupedFrozenLinear.apply(grouped, self._kit_packed_gate_up, offsets)
    down = GroupedFrozenLinear.apply(self._apply_gate(up), self._kit_packed_down, offsets)
    weighted = down * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    out = weighted[inverse].view(num_tokens, num_top_k, hidden_dim).float().sum(dim=1)
    return out.to(hidden_states.dtype)


def _groupable(module) -> bool:
    """An experts module transformers dispatches by ``config._experts_implementation`` whose weights are the
    kit's 4-bit experts in the plain layout (concatenated gate/up, not transposed, no bias, no expert parallel)."""
    return (
        isinstance(getattr(module, "gate_up_proj", None), QuantizedExpertWeights)
        and isinstance(getattr(module, "down_proj", None), QuantizedExpertWeights)
        and hasattr(module, "config")
        and hasattr(module, "_apply_gate")
        and getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "has_post_expert_norm", False)
        and not getattr(module, "_is_expert_parallel", False)
    )


def patch_quantized_experts(model) -> int:
    """Route every 4-bit experts module of ``model`` through ``grouped_experts_forward``; returns how many."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, grouped_experts_forward)
    patched = 0
    for module in model.modules():
        if not _groupable(module):
            continue
        gate_up, down = pack_experts(module.gate_up_proj), pack_experts(module.down_proj)
        if gate_up is None or down is None:
            continue
        module._kit_packed_gate_up, module._kit_packed_down = gate_up, down
        module.config = copy.copy(module.config)
        module.config._experts_implementation = IMPLEMENTATION
        patched += 1
    return patched
