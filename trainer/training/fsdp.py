"""FSDP2 through accelerate: the plugin from the config, the wrapping classes, and the checkpoint's state.

Every rank holds 1/N of the parameters, gradients and optimizer state; a decoder layer's weights are gathered
just before it runs and freed after (``fsdp.reshard_after_forward``). accelerate's ``fsdp2_prepare_model``
does the wrapping (``fully_shard`` per decoder layer, then the embeddings, the head and the root); this module
builds its plugin and the few things the kit needs around it:

- the classes that become one FSDP unit each, checked against the model so a typo is one line;
- a checkpoint's sharded training state (optimizer, and for full fine-tuning the model, through
  torch.distributed.checkpoint as accelerate writes it) next to the weights consolidated on rank 0, which
  ``from_pretrained`` loads on one process. LoRA's frozen base is never written: its adapter, consolidated,
  is all a resume needs (it holds the exact fp32 values).

accelerate turns FSDP on only for accelerator processes (MULTI_GPU and kin); on CPU processes (gloo) torch's
``fully_shard`` works all the same, so ``enable_on_cpu`` switches the state's type itself: that is how the
CPU tests run this very code.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from trainer.config import Config

CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # what fsdp.activation_checkpointing adds to names


class FsdpError(ValueError):
    """A model or setting FSDP cannot run with, in one line naming the key."""


def wanted(cfg: Config) -> bool:
    return cfg.training.distributed == "fsdp"


def make_plugin(cfg: Config):
    """accelerate's FSDP2 plugin from the fsdp section: per-layer wrapping, the options, the checkpoint format."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    f = cfg.fsdp
    with warnings.catch_warnings():  # accelerate warns that FSDP2 is new; the docs say what it does here
        warnings.simplefilter("ignore")
        return FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=f.reshard_after_forward,
            cpu_offload=f.cpu_offload,
            activation_checkpointing=f.activation_checkpointing,
            # not accelerate's rank-0 broadcast: with transformers 5 every rank still reads the whole model
            # first; the kit loads in shards itself (trainer/model/sharded_loading.py)
            cpu_ram_efficient_loading=False,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(f.wrap_classes) if f.wrap_classes else None,
            # Each rank writes its shard of the training state (torch.distributed.checkpoint); the weights are
            # also gathered whole by the checkpoint code. (FULL_STATE_DICT fails on the optimizer in torch 2.13.)
            state_dict_type="SHARDED_STATE_DICT",
        )


def enable_on_cpu(accelerator, plugin) -> None:
    """Several CPU processes: accelerate leaves them MULTI_CPU (DDP); FSDP2 runs on gloo too, so say FSDP.

    Both shared states carry the type: AcceleratorState copies PartialState's whenever it is built again.
    The plugin also gets the mixed-precision policy accelerate gives it on GPUs (gather in bf16, reduce in
    bf16), so CPU runs shard and cast as GPU runs do."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin


def active(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


# ---------------------------------------------------------------- wrapping


def wrap_classes(model: torch.nn.Module, configured: list[str] | None = None) -> list[str]:
    """The class names that become one FSDP unit each: the configured ones, else the model's decoder layer.

    transformers names it in ``_no_split_modules`` (a PEFT model forwards the attribute to its base); names
    there that this model does not contain (a vision tower's block) are left out."""
    present = {type(module).__name__ for module in model.modules()}
    if configured:
        missing = [name for name in configured if name not in present]
        if missing:
            layers = sorted(n for n in present if n.endswith(("Layer", "Block")))
            raise FsdpError(
                f"fsdp.wrap_classes: no module of class {missing[0]} in this model "
                f"(its layer classes: {', '.join(layers) or 'none'})"
            )
        return list(configured)
    names = [name for name in (getattr(model, "_no_split_modules", None) or []) if name in present]
    if not names:
        raise FsdpError(
            f"fsdp.wrap_classes: {type(model).__name__} names no decoder-layer class (_no_split_modules); "
            "set fsdp.wrap_classes to the class of its repeated layer"
        )
    return names


def prepare_wrapping(accelerator, model: torch.nn.Module, cfg: Config) -> list[str]:
    """Give accelerate the checked class names before ``prepare`` wraps the model; returns them."""
    names = wrap_classes(model, cfg.fsdp.wrap_classes)
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = names
    return names


def after_prepare(model: torch.nn.Module) -> bool:
    """What accelerate's wrapping leaves to us: a frozen input embedding is not gathered again in backward.

    FSDP2 gathers a unit in backward when a gradient reaches its output, and prefetches the unit that ran
    before the current one; both happen to the embedding (transformers 5 makes its output require grad
    under checkpointing), though a frozen embedding computes nothing there: with a 128k vocabulary that is
    1 GiB gathered per micro-batch for nothing. Returns whether it applied."""
    from torch.distributed.fsdp import FSDPModule

    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, FSDPModule) or any(p.requires_grad for p in embedding.parameters()):
        return False
    if head is not None and getattr(head, "weight", None) is embedding.weight:
        return False  # tied: one unit with the head, which backward needs
    embedding.set_unshard_in_backward(False)
    return True


def decoder_units(model: torch.nn.Module, layer_classes: list[str]) -> list:
    """The FSDP units of the decoder layers (``prepare_wrapping``'s classes), in the model's order."""
    from torch.distributed.fsdp import FSDPModule

    wanted = set(layer_classes)
    return [
        m
        for m in model.modules()
        if isinstance(m, FSDPModule) and any(c.__name__ in wanted for c in type(m).__mro__[1:])
    ]


def keep_last_layer_gathered(model: torch.nn.Module, layer_classes: list[str]) -> bool:
    """The last decoder layer keeps its gathered weights from its forward to its backward.

    Only the final norm, the head and the loss run between the two, so resharding it would gather it again at
    once, with little to hide behind (nothing under the fused loss, which computes the head's gradients in
    forward). One all-gather less per micro-batch, for one layer held through the loss (as torchtitan does)."""
    layers = decoder_units(model, layer_classes)
    if not layers:
        return False
    layers[-1].set_reshard_after_forward(False, recurse=False)
    return True


def forward_prefetch(model: torch.nn.Module, layer_classes: list[str], ahead: int) -> int:
    """Each FSDP unit starts the all-gathers of the next ``ahead`` units as it begins its forward
    (``set_modules_to_forward_prefetch``); returns how many units prefetch.

    Without this FSDP2 issues a layer's all-gather when the host reaches that layer's forward. Whenever the
    GPU waits on the host (multi-process steps run their layers eagerly, with no CUDA graphs; small
    micro-batches), the GPU has finished this layer by then, and the gather runs alone. Issued one unit
    earlier it runs beside this layer's kernels. The chain is the forward's order: an untied embedding, the
    decoder layers as the model lists them, an untied head (its unit with the final norm). A tied embedding
    and head are one unit that stays gathered from the forward's start, so it needs no prefetch."""
    from torch.distributed.fsdp import FSDPModule

    if ahead <= 0:
        return 0
    layers = decoder_units(model, layer_classes)
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", None)
    chain = [embedding] if isinstance(embedding, FSDPModule) and not tied else []
    chain += layers
    if isinstance(head, FSDPModule) and not tied:
        chain.append(head)
    for at, unit in enumerate(chain[:-1]):
        unit.set_modules_to_forward_prefetch(chain[at + 1 : at + 1 + ahead])
    return max(0, len(chain) - 1)


def optimizer_names(model: torch.nn.Module, optimizer) -> list[list[str]]:
    """Each parameter group's parameters by name, read before ``prepare``. accelerate maps an optimizer onto
    the sharded parameters by data address, and the meta stand-ins of sharded loading all have address 0."""
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    names = {id(p): n for n, p in fsdp2_canonicalize_names(dict(model.named_parameters())).items()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def remap_optimizer(model: torch.nn.Module, optimizer, names: list[list[str]]) -> None:
    """After ``prepare``: point each parameter group at the sharded parameters of the names
    ``optimizer_names`` read (the optimizer has taken no step, so it holds no state to move)."""
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    sharded = fsdp2_canonicalize_names(dict(model.named_parameters()))
    missing = [n for group in names for n in group if n not in sharded]
    if missing:
        raise RuntimeError(f"sharded loading: parameters missing after sharding: {missing[:5]}")
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [sharded[n] for n in group_names]


def parameter_bytes(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """This rank's parameters by role and dtype ({"frozen": {"bfloat16": n}, "trainable": {...}}): its
    shards under FSDP, each storage counted once."""
    from torch.distributed.tensor import DTensor

    found: dict[str, dict[str, int]] = {"frozen": {}, "trainable": {}}
    for param in model.parameters():  # parameters() yields a tied parameter once
        local = param.to_local() if isinstance(param, DTensor) else param
        role = found["trainable" if param.requires_grad else "frozen"]
        dtype = str(local.dtype).removeprefix("torch.")
        role[dtype] = role.get(dtype, 0) + local.numel() * local.element_size()
    return found


def sharded_line(accelerator, model: torch.nn.Module) -> str:
    """What this rank holds once sharded, by role and dtype (frozen weights keep their storage dtype)."""
    found = parameter_bytes(model)
    total = sum(n for role in found.values() for n in role.values())
    return (
        f"fsdp sharded: rank {accelerator.process_index} holds {total} bytes ({total / 2**20:.1f} MiB) "
        f"of parameters {json.dumps(found, sort_keys=True)}"
    )


def held_bytes(model: torch.nn.Module, shards=None) -> int:
    """Bytes of weights this rank holds: the model's materialised parameters and buffers (each storage
    once) plus what sharded loading keeps aside for the shards. Measured right before sharding, it is the
    load-time footprint: the whole model without sharded loading, about 1/N with it."""
    seen, total = set(), 0
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_meta or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total + (shards.held_bytes if shards is not None else 0)


def loading_line(accelerator, model: torch.nn.Module, shards=None) -> str:
    """What this rank holds right before sharding, and on a GPU the peak allocated so far (the load's)."""
    held = held_bytes(model, shards)
    line = (
        f"fsdp loading: rank {accelerator.process_index} holds {held} bytes ({held / 2**20:.1f} MiB) "
        "of weights before sharding"
    )
    if shards is not None:
        line += (
            f" (loaded in shards: at most {shards.peak_bytes / 2**20:.1f} MiB kept plus the tensor in hand)"
        )
    if accelerator.device.type == "cuda":
        line += (
            f"; GPU peak while loading {torch.cuda.max_memory_allocated(accelerator.device) / 2**20:.0f} MiB"
        )
    return line


def fill_loaded_shards(accelerator, shards, cpu_offload: bool) -> int:
    """After ``prepare``: each rank's shards of the weights that sharded loading kept aside (on the CPU
    where fsdp.cpu_offload keeps the shards)."""
    device = torch.device("cpu") if cpu_offload else accelerator.device
    return shards.materialise(device)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered layer. A forward without backward (evaluation, generation) leaves the layers
    that keep their weights after forward (fsdp.reshard_after_forward: false, and always the root) gathered:
    whole weights in memory, and parameters the optimizer does not know."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# ---------------------------------------------------------------- consolidated weights (rank 0)


def clean_name(name: str) -> str:
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a sharded DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gather_trainable(model: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """The trainable parameters (LoRA's adapter), whole, on rank 0's CPU; {} elsewhere.

    One all-gather per parameter, in the same order on every rank; only the adapter's bytes move."""
    gathered = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        full = _full(param.detach())
        if is_main:
            gathered[clean_name(name)] = full.cpu().clone()
    return gathered


def gather_full_model(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, whole, on rank 0's CPU (others get {}): the full fine-tune's consolidated model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_adapter(
    model: torch.nn.Module, saved: dict[str, torch.Tensor], adapter_name: str = "default"
) -> int:
    """Copy a consolidated adapter (PEFT's file keys, without the adapter name) into the sharded model.

    Every rank holds the small file whole and keeps its own shard of each tensor; returns how many were set."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            key = clean_name(name).replace(f".{adapter_name}", "")
            if key not in saved:
                raise FsdpError(f"checkpoint: the adapter file has no tensor for {key}")
            full = saved[key].to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                shard = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(shard)
            else:
                param.copy_(full)
            count += 1
    return count


# ---------------------------------------------------------------- the checkpoint's training state


def save_training_state(accelerator, model, optimizer, scheduler, directory: Path, with_model: bool) -> None:
    """Optimizer (and, for full fine-tuning, model) state as accelerate writes it for FSDP2: each rank its
    shard (torch.distributed.checkpoint); scheduler and every rank's RNG state beside them. Every rank
    calls it."""
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    reshard(model)
    directory.mkdir(parents=True, exist_ok=True)
    if with_model:
        save_fsdp_model(plugin, accelerator, model, str(directory))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(directory))
    save_accelerator_state(
        str(directory),
        [],
        [],
        [scheduler],
        [],
        accelerator.process_index,
        accelerator.step,
        accelerator.scaler,
    )


def load_training_state(accelerator, model, optimizer, scheduler, directory: Path, with_model: bool) -> None:
    """The counterpart of ``save_training_state``; every rank calls it."""
    from accelerate.checkpointing import load_accelerator_state
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    if with_model:
        load_fsdp_model(plugin, accelerator, model, str(directory))
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(directory))
    load_accelerator_state(str(directory), [], [], [scheduler], [], accelerator.process_index)


def is_sharded_state(directory: Path) -> bool:
    """Whether a checkpoint's training state was written by FSDP (a sharded optimizer directory)."""
    return (directory / "optimizer_0").is_dir()


def load_sharded_state_unsharded(accelerator, model, optimizer, scheduler, directory: Path) -> None:
    """An FSDP checkpoint's training state into a run without FSDP (one process, or DDP): every process
    reads the whole optimizer state from the shards (torch.distributed.checkpoint reassembles them, with or
    without a process group), then the scheduler and its own RNG state as accelerate saved them. The weights
    come from the consolidated adapter or model beside it, as for any checkpoint."""
    import torch.distributed.checkpoint as dcp
    from accelerate.checkpointing import load_accelerator_state
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    plain_model = accelerator.unwrap_model(model)
    plain_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper around it
    state = {"optimizer": get_optimizer_state_dict(plain_model, plain_optimizer)}  # keys by parameter name
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory / "optimizer_0")))
    set_optimizer_state_dict(plain_model, plain_optimizer, state["optimizer"])
    load_accelerator_state(str(directory), [], [], [scheduler], [], accelerator.process_index)
