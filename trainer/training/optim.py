"""Optimizer and learning-rate schedule, built from the optimization section of the config."""

from __future__ import annotations

import math

import torch

from trainer.config import Config
from trainer.fastpath.lora_ops import track_updates


def make_optimizer(model, cfg: Config, on_cuda: bool):
    """AdamW, or bitsandbytes' 8-bit / paged variants (CUDA only: they page through unified memory).

    Biases and norms (parameters under two dimensions) get no weight decay, nor parameters marked
    ``_no_weight_decay`` (Mamba's A_log and D, SDLoRA's partly frozen SSM tensors: decay would move
    entries whose gradient is masked to zero)."""
    o = cfg.optimization
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]
    no_decay = [p for p in params if p.dim() < 2 or getattr(p, "_no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": o.learning_rate, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_epsilon}
    fused = fused_on(cfg, on_cuda)
    optimizer = _build(groups, kwargs, o.optimizer, on_cuda, fused)
    track_updates(optimizer)  # the fast path's cast cache learns of every update, whatever optimizer made it
    return optimizer


def fused_on(cfg: Config, on_cuda: bool) -> bool:
    """Whether AdamW runs fused: on a CUDA run, wherever its parameters are now. A model that is not quantized
    loads on the host and ``accelerator.prepare`` moves it to the GPU after the optimizer is built, so asking
    where the parameters are would keep every LoRA run on the multi-tensor path (one host call per parameter's
    step count, and no skipping on the device: ``loop.skips_on_device``). FSDP's ``fully_shard`` moves them to
    the GPU the same way, unless ``fsdp.cpu_offload`` keeps the shards, and so the update, on the host."""
    if cfg.training.distributed == "fsdp" and cfg.fsdp.cpu_offload:
        return False
    return on_cuda


def _build(groups: list, kwargs: dict, name: str, on_cuda: bool, fused: bool):
    if name == "adamw":
        # On CUDA one fused kernel updates every tensor (what transformers' Trainer defaults to): the
        # multi-tensor path reads each parameter's step count on the host, hundreds of calls per step for
        # LoRA's many small tensors. CPU keeps the multi-tensor path the CPU tests compare with Trainer on.
        return torch.optim.AdamW(groups, **kwargs, fused=True if fused else None)
    if not on_cuda:
        raise RuntimeError(f"optimization.optimizer: {name} needs a CUDA GPU; use adamw on CPU")
    import bitsandbytes as bnb

    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[name]
    return cls(groups, **kwargs)


def repage_state(optimizer) -> int:
    """Put a resumed paged optimizer's state back into paged memory; returns how many tensors moved.

    bitsandbytes' paged optimizers allocate each large state tensor in CUDA unified memory, which the driver
    evicts to the host when the card fills up. Loading a checkpoint (``load_state_dict`` and accelerate's
    device placement) brings the state back as ordinary device tensors, so a resumed run would hold all of it
    on the GPU and could run out of memory where the first run did not (measured on an H100: 0 paged tensors
    after a resume). Each tensor the optimizer would have paged is copied into a fresh paged buffer."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the real one
    if not getattr(inner, "is_paged", False):
        return 0
    moved = 0
    for state in inner.state.values():
        for key in ("state1", "state2"):
            value = state.get(key)
            if torch.is_tensor(value) and value.numel() >= 1e5 and not getattr(value, "is_paged", False):
                buffer = inner.get_state_buffer(value, dtype=value.dtype)  # bitsandbytes' own allocation
                buffer.copy_(value)
                state[key] = buffer
                moved += 1
    return moved


def warmup_steps(cfg: Config, total_steps: int) -> int:
    o = cfg.optimization
    return o.warmup_steps if o.warmup_steps > 0 else int(math.ceil(o.warmup_ratio * total_steps))


def make_scheduler(optimizer, cfg: Config, total_steps: int):
    """transformers' schedules; ``constant`` keeps its warmup, ``min_lr_ratio`` sets the floor."""
    from transformers import get_scheduler

    o = cfg.optimization
    name, extra = o.lr_scheduler, {}
    warmup = warmup_steps(cfg, total_steps)
    if name == "constant":
        name = "constant_with_warmup"
    elif name == "cosine" and o.min_lr_ratio > 0:
        name, extra = "cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}
    elif name == "polynomial":
        extra = {"power": o.polynomial_power, "lr_end": o.learning_rate * o.min_lr_ratio}
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra or None,
    )
