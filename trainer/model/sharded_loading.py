"""QLoRA under FSDP without the whole model on any rank: each rank keeps only its shard of every weight.

bitsandbytes quantizes while transformers loads, so FSDP's usual answers (accelerate's
``cpu_ram_efficient_loading``: rank 0 loads, the others start on meta and receive their shards) skip 4-bit
models, and every rank would hold the whole 4-bit model on its GPU before ``fully_shard`` cuts it.
Here transformers loads and quantizes as it always does (its key renames, fused experts, pre-quantized
checkpoints, bitsandbytes' quantizer all stay theirs), one tensor at a time; the moment a tensor is set on
its module, a parameter-registration hook keeps this rank's dim-0 chunk of it (the chunk ``fully_shard``
will give this rank) and leaves an empty stand-in. The peak on a rank is its shard plus one tensor.

The stand-ins are empty real tensors on the loading device while PEFT runs (PEFT puts adapters where the
base weight lives, so meta would put LoRA on meta), then meta tensors of the true shape
(``to_meta``), which ``fully_shard`` shards without allocating. After ``accelerator.prepare``,
``materialise`` allocates each local shard and copies the kept chunk in. bitsandbytes' quantization state
(absmax, nested absmax and code: about 1/16 of the 4-bit bytes, 1/64 with double quantization) stays whole
on every rank, as on the ordinary path: the 4-bit matmul reads it whole.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def local_chunk(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``tensor`` as FSDP2 cuts it: ``torch.chunk`` along dim 0, empty past the end."""
    chunks = torch.chunk(tensor, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return tensor.new_empty((0, *tensor.shape[1:]))


def _with_data(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter of the same class and attributes (bitsandbytes' quant_state, transformers' flags) on
    other data."""
    new = type(param).__new__(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


@dataclass
class Kept:
    """What this rank keeps of one parameter: its true shape and its own chunk."""

    shape: torch.Size
    chunk: torch.Tensor


@dataclass
class KeptExperts:
    """A fused 3-D expert weight, quantized expert by expert while it was whole: each expert's packed
    bytes as this rank's chunk, and the quantization states (kept whole, as for Linear4bit)."""

    shape: tuple
    compute_dtype: torch.dtype
    packed: list[Kept]
    states: list
    storage: torch.dtype


@dataclass
class ShardedLoad:
    """Loading in shards on one rank of ``world``; ``expert_quant`` (quant_type, double_quant, storage)
    when fused experts become 4-bit (quantization.quantize_experts)."""

    rank: int
    world: int
    expert_quant: tuple | None = None
    kept: dict = field(default_factory=dict)  # id(stand-in) -> Kept | KeptExperts
    stand_ins: dict = field(default_factory=dict)  # id(stand-in) -> the stand-in (alive while loading)
    slots: dict = field(default_factory=dict)  # after to_meta: (id(module), name) -> (module, name, Kept)
    whole_bytes: int = 0  # the base weights' bytes, had they been kept whole
    held_bytes: int = 0  # what this rank keeps
    peak_bytes: int = 0  # kept so far plus the tensor in hand, at its largest

    @contextmanager
    def capture(self):
        """Every parameter registered inside (transformers' ``from_pretrained``) goes through ``_keep``."""
        handle = nn.modules.module.register_module_parameter_registration_hook(self._on_register)
        try:
            yield self
        finally:
            handle.remove()

    def _on_register(self, module: nn.Module, name: str, param):
        if param is None or param.is_meta or id(param) in self.stand_ins:
            return None  # built on meta, or tied to a stand-in already kept
        if not getattr(param, "_is_hf_initialized", False) or param.dim() == 0:
            return None  # not read from the checkpoint (a missing key initialised in place), or a scalar
        return self._keep(param)

    def _keep(self, param: nn.Parameter) -> nn.Parameter:
        whole = param.detach()
        nbytes = whole.numel() * whole.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + nbytes)
        self.whole_bytes += nbytes
        if self.expert_quant and whole.dim() == 3 and whole.is_floating_point():
            kept = self._quantize_experts(whole)
            held = sum(k.chunk.numel() * k.chunk.element_size() for k in kept.packed)
        else:
            kept = Kept(whole.shape, local_chunk(whole, self.rank, self.world).clone())
            held = kept.chunk.numel() * kept.chunk.element_size()
        self.held_bytes += held
        # no elements, the same number of dimensions and trailing sizes (code that asks for dim() is answered)
        stand_in = _with_data(param, whole.new_empty((0, *whole.shape[1:])))
        self.kept[id(stand_in)] = kept
        self.stand_ins[id(stand_in)] = stand_in
        return stand_in

    def _quantize_experts(self, whole: torch.Tensor) -> KeptExperts:
        """As ``QuantizedExpertWeights`` does, while the tensor is whole; each expert's packed bytes are
        then cut like any parameter."""
        import bitsandbytes.functional as bnbf

        quant_type, double_quant, storage = self.expert_quant
        packed, states = [], []
        for index in range(whole.shape[0]):
            data, state = bnbf.quantize_4bit(
                whole[index].contiguous(),
                blocksize=64,
                compress_statistics=double_quant,
                quant_type=quant_type,
            )
            if data.numel() % storage.itemsize:
                raise ValueError(
                    f"fsdp.cpu_ram_efficient_loading: an expert's {data.numel()} packed bytes do not fill "
                    f"{storage} elements; set quantization.quantize_experts: false"
                )
            flat = data.reshape(-1).view(storage)
            packed.append(Kept(flat.shape, local_chunk(flat, self.rank, self.world).clone()))
            states.append(state)
        return KeptExperts(tuple(whole.shape), whole.dtype, packed, states, storage)

    # ---------------------------------------------------------------- after loading

    def take_experts(self, weight: nn.Parameter) -> KeptExperts:
        """The fused expert weight kept for ``weight`` (its stand-in), which the caller replaces."""
        kept = self.kept.pop(id(weight), None)
        self.stand_ins.pop(id(weight), None)
        if not isinstance(kept, KeptExperts):
            raise ValueError(
                "fsdp.cpu_ram_efficient_loading: a fused expert weight was not loaded as 4-bit experts"
            )
        return kept

    def keep_stand_in(self, param: nn.Parameter, shape: torch.Size, chunk: torch.Tensor) -> None:
        """Register a stand-in made after loading (the packed experts' parameters)."""
        self.kept[id(param)] = Kept(shape, chunk)
        self.stand_ins[id(param)] = param

    def to_meta(self, model: nn.Module) -> None:
        """Give every stand-in its true shape on meta, for ``fully_shard`` (after PEFT, before prepare).

        Tied weights share one stand-in, so every module holding it gets the same meta parameter. From here
        on the kept chunks are found by module and name: ``fully_shard`` replaces the parameters."""
        replaced: dict[int, nn.Parameter] = {}
        slots = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or id(param) not in self.kept:
                    continue
                entry = self.kept[id(param)]
                if isinstance(entry, KeptExperts):
                    raise ValueError(
                        f"fsdp.cpu_ram_efficient_loading: {type(module).__name__}.{name} was quantized as "
                        "fused experts but is not one; set quantization.quantize_experts: false"
                    )
                if id(param) not in replaced:
                    meta = torch.empty(entry.shape, dtype=param.dtype, device="meta")
                    replaced[id(param)] = _with_data(param, meta)
                    slots[(id(module), name)] = (module, name, entry)
                module._parameters[name] = replaced[id(param)]
        if len(replaced) != len(self.kept):
            raise RuntimeError("sharded loading: a kept weight is no longer in the model")
        self.kept, self.stand_ins, self.slots = {}, {}, slots

    def materialise(self, device: torch.device) -> int:
        """After ``fully_shard``: allocate each meta shard on ``device`` and copy this rank's chunk in.

        FSDP2's way to initialise from meta (as ``to_empty`` does: the tensor is swapped in place, so FSDP
        and tied modules keep the same parameter object); only the kept parameters are touched, adapters
        and buffers keep their values. Returns how many parameters were filled."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for module, name, entry in self.slots.values():
                param = module._parameters[name]
                if not param.is_meta:
                    raise RuntimeError(
                        f"sharded loading: {type(module).__name__}.{name} is no longer on meta"
                    )
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.numel() == 0 == entry.chunk.numel():
                    continue  # a rank past the end of a short dim 0 (FSDP's empty shard may be 1-D)
                if local.shape != entry.chunk.shape:
                    raise RuntimeError(
                        f"sharded loading: {type(module).__name__}.{name}: this rank's shard is "
                        f"{tuple(local.shape)}, the kept chunk {tuple(entry.chunk.shape)}"
                    )
                local.copy_(entry.chunk)
        filled = len(self.slots)
        self.slots = {}
        return filled
