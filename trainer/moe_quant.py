"""4-bit storage for fused MoE expert weights, which bitsandbytes' Linear replacement misses.

transformers 5 stores each MoE layer's experts as 3-D ``nn.Parameter``s (experts x out x in),
so loading with ``load_in_4bit`` quantizes attention but leaves the experts (most of a MoE
model's bytes) in 16-bit (bitsandbytes issue 1849). Here each expert's matrix is quantized
separately with bitsandbytes (NF4/FP4, optional double quant) and dequantized one expert at a
time when the experts' forward indexes it (``self.gate_up_proj[expert_idx]``), so only one
expert is ever held in 16-bit. The weights are frozen: LoRA goes on attention (or shared
experts), as in QLoRA.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class QuantizedExpertWeights(nn.Module):
    """Stands in for a 3-D expert parameter; ``[i]`` returns expert i dequantized."""

    def __init__(
        self, weight: torch.Tensor, quant_type: str, double_quant: bool, storage: torch.dtype = torch.uint8
    ):
        super().__init__()
        import bitsandbytes.functional as bnbf

        self.shape = tuple(weight.shape)
        self.compute_dtype = weight.dtype  # the dtype the experts' forward multiplies in
        self.quant_states = []
        for index in range(weight.shape[0]):
            packed, state = bnbf.quantize_4bit(
                weight[index].detach().contiguous(),
                blocksize=64,
                compress_statistics=double_quant,
                quant_type=quant_type,
            )
            if storage != torch.uint8 and packed.numel() % storage.itemsize == 0:
                # Same bytes, seen as a floating tensor FSDP can shard; viewed back as bytes to dequantize.
                stored = packed.reshape(-1).view(storage)
                self.register_parameter(f"packed_{index}", nn.Parameter(stored, requires_grad=False))
            else:
                self.register_buffer(f"packed_{index}", packed)
            self.quant_states.append(state)

    @classmethod
    def from_quantized(
        cls, shape: tuple, compute_dtype: torch.dtype, packed: list[nn.Parameter], states: list
    ) -> QuantizedExpertWeights:
        """Experts quantized elsewhere (sharded loading, trainer/model/sharded_loading.py): their packed
        bytes as floating parameters, one per expert, and their quantization states."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.shape, self.compute_dtype, self.quant_states = tuple(shape), compute_dtype, list(states)
        for index, param in enumerate(packed):
            self.register_parameter(f"packed_{index}", param)
        return self

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        index = int(index)
        packed = getattr(self, f"packed_{index}")
        if packed.dtype != torch.uint8:
            packed = packed.view(torch.uint8).reshape(-1, 1)
        return bnbf.dequantize_4bit(packed, self.quant_states[index]).to(self.compute_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.packed_0.device

    def numel(self) -> int:
        return int(torch.tensor(self.shape).prod())

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.buffers(), *self.parameters()))


def fused_expert_parameters(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, parameter name, qualified name) for every 3-D parameter of an experts module."""
    found = []
    for module_name, module in model.named_modules():
        if "expert" not in module_name.rsplit(".", 1)[-1]:
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                found.append((module, name, f"{module_name}.{name}"))
    return found


def quantize_fused_experts(
    model: nn.Module, quant_type: str, double_quant: bool, storage: torch.dtype = torch.uint8, shards=None
) -> int:
    """Replace fused expert parameters by 4-bit storage in place; returns how many were replaced.

    With ``shards`` (a ``ShardedLoad``) the experts were quantized while loading and only this rank's
    chunks kept: the module is built from those, with stand-ins the sharded loading fills later."""
    replaced = 0
    for module, name, _ in fused_expert_parameters(model):
        weight = getattr(module, name)
        if shards is None:
            quantized = QuantizedExpertWeights(weight, quant_type, double_quant, storage)
        else:
            quantized = _from_shards(shards, weight)
        delattr(module, name)
        module.add_module(name, quantized)
        if hasattr(module, "config") and getattr(module.config, "_experts_implementation", None) not in (
            None,
            "eager",
        ):
            # Grouped-GEMM implementations read the whole 3-D tensor; the eager loop indexes one expert.
            module.config = copy.copy(module.config)
            module.config._experts_implementation = "eager"
        del weight
        replaced += 1
    return replaced


def _from_shards(shards, weight: nn.Parameter) -> QuantizedExpertWeights:
    kept = shards.take_experts(weight)
    packed = []
    for piece in kept.packed:
        stand_in = nn.Parameter(piece.chunk.new_empty(0), requires_grad=False)
        shards.keep_stand_in(stand_in, piece.shape, piece.chunk)
        packed.append(stand_in)
    return QuantizedExpertWeights.from_quantized(kept.shape, kept.compute_dtype, packed, kept.states)
