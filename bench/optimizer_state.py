"""Does a checkpoint's optimizer state come back whole? For bench_core_gpu.py's optimizer check (issue 14):
the saved ``optimizer.bin`` is loaded as a resume loads it, put into a fresh optimizer of the class the kit
builds for that ``optimization.optimizer`` value, and read back for comparison.

bitsandbytes' optimizers nest their state tensors in a sub-dict of ``state_dict()``, and their
``load_state_dict`` (0.50) moves them onto the device with a plain ``.to``: read so, a paged optimizer's
state is no longer paged after a resume (measured on an H100: 0 paged tensors), which the kit's resume
repairs (``trainer.training.optim.repage_state``). The check loads as the kit does and counts paged tensors
after loading; a fresh step on a large tensor says whether this optimizer pages at all.
"""

from __future__ import annotations

from pathlib import Path

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")  # optimization.optimizer


def optimizer_class(name: str):
    """The class the kit builds for optimization.optimizer ``name`` (trainer/training/optim.py)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW
    import bitsandbytes as bnb

    return {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[name]


BNB_WRAPPED = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict() nests its state tensors


def flat_state(state: dict, prefix: str = "") -> dict:
    """One parameter's optimizer state as key -> value; bitsandbytes nests its quantization tensors in a
    sub-dict of its state_dict() (for FSDP), which becomes 'sub.key'."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat_state(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def same_value(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def optimizer_state_check(state_file: Path, name: str, expected_params: int, dtype=None, device=None) -> dict:
    """Load a checkpoint's optimizer.bin the way a resume does (accelerate's loader, onto the CPU), put it into
    a fresh optimizer of the class ``name`` makes, over parameters shaped like the saved state, and read it
    back: every trainable parameter must have state, and the state read back must equal what was saved."""
    import torch
    from accelerate.utils import load

    from trainer.training.optim import repage_state

    saved = load(state_file, map_location="cpu")
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    states = {index: flat_state(state) for index, state in saved["state"].items()}
    result = {"params_with_state": len(states), "expected_params": expected_params, "param_groups": sizes}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    groups = []
    for group in saved["param_groups"]:
        members = []
        for index in group["params"]:
            state = states.get(index, {})
            # the first moment, torch's or bitsandbytes' (8-bit or 32-bit), has the parameter's shape
            moment = state.get("exp_avg", state.get(f"{BNB_WRAPPED}.state1"))
            if not torch.is_tensor(moment):
                return {**result, "error": f"no exp_avg or state1 in the saved state of parameter {index}"}
            members.append(
                torch.nn.Parameter(torch.zeros(moment.shape, dtype=dtype or torch.float32, device=device))
            )
        groups.append({"params": members})
    every = [param for group in groups for param in group["params"]]
    if not every:
        return {**result, "error": "the saved optimizer has no parameters"}
    fresh = optimizer_class(name)(groups, lr=1e-4)
    fresh.load_state_dict(saved)
    repage_state(fresh)  # what the kit's resume does after loading (trainer.training.checkpointing.restore)
    back = {index: flat_state(state) for index, state in fresh.state_dict()["state"].items()}
    differing = sorted(
        f"{index}:{key}"
        for index in set(states) | set(back)
        for key in set(states.get(index, {})) | set(back.get(index, {}))
        if not same_value(states.get(index, {}).get(key), back.get(index, {}).get(key))
    )
    eight_bit = [
        s for s in states.values() if getattr(s.get(f"{BNB_WRAPPED}.state1"), "dtype", None) == torch.uint8
    ]
    loaded = [value for state in fresh.state.values() for value in state.values() if torch.is_tensor(value)]
    # one step from scratch, on a tensor large enough that bitsandbytes pages its state (>= 1e5 elements)
    probe_param = torch.nn.Parameter(torch.zeros(512, 256, device=device))
    probe = optimizer_class(name)([probe_param], lr=1e-4)
    probe_param.grad = torch.zeros_like(probe_param)
    probe.step()
    fresh_paged = any(getattr(v, "is_paged", False) for state in probe.state.values() for v in state.values())
    return {
        **result,
        "class": type(fresh).__name__,
        "every_param_has_state": len(states) == expected_params == sum(sizes),
        "identical_after_load": not differing,
        "differing": differing[:10],
        "params_with_8bit_state": len(eight_bit),
        # bitsandbytes' load_state_dict moves the state onto the device as ordinary tensors; the kit's
        # repage_state puts the large ones back into paged memory: after a resume, as many as when fresh
        "fresh_state_paged": fresh_paged,
        "paged_tensors_after_load": sum(1 for t in loaded if getattr(t, "is_paged", False)),
    }


def checkpoint_optimizer_check(checkpoint: Path, name: str) -> dict:
    """optimizer_state_check on a kit checkpoint: its trainable parameters are the adapter's tensors."""
    from safetensors import safe_open

    from trainer.training.checkpoint_files import STATE_DIR

    try:
        with safe_open(str(checkpoint / "adapter_model.safetensors"), "pt") as adapter:
            keys = list(adapter.keys())
            dtype = adapter.get_tensor(keys[0]).dtype if keys else None
        return optimizer_state_check(checkpoint / STATE_DIR / "optimizer.bin", name, len(keys), dtype)
    except Exception as exc:  # reported in the row; the benchmark goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}
