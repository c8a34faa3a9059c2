"""Gated Linear Attention through flash-linear-attention (fla), with a reference path that really runs it.

fla's GLA ops and fused norms are Triton kernels, which need a GPU. On the reference path (always without
CUDA; on a GPU when the start-up self-check fails or ``model.kernel_path: fla-naive-torch`` says so) this
family swaps them, in the loaded model only, for PyTorch code: the GLA op for fla's own reference
(``fla.ops.gla.naive``) and each fused norm/activation module for the same maths in torch (same
parameters, so checkpoints load and save unchanged). On the Triton path, fla's kernels run untouched,
after ``trainer/families/gla_checks.py`` has compared them with that reference on the run's GPU.

GLA ignores ``position_ids``, so packed rows are cut at document boundaries with ``cu_seqlens``
(fla's varlen mode, batch size 1): ``model_inputs`` flattens a packed micro-batch into one row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.families import fla_tuning, register
from trainer.families.base import Family, ModelLoadError, current_kernel_path
from trainer.families.extras import MODEL_TYPES
from trainer.families.gla_reference import naive_gla
from trainer.families.gla_reference import torch_rms_norm as _torch_rms_norm

KERNEL_TRITON = "fla-triton"
KERNEL_REFERENCE = "fla-naive-torch"
KERNEL_PATHS = (KERNEL_TRITON, KERNEL_REFERENCE)
# The names fla.layers.gla binds its ops under (swapped for the reference path, put back for Triton).
GLA_OPS = ("chunk_gla", "fused_chunk_gla", "fused_recurrent_gla")
TORCH_ACTIVATIONS = {
    "swish": F.silu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "gelu": F.gelu,
}


def _import_fla():
    try:
        import fla  # noqa: F401 - registers 'gla' with transformers' Auto classes
        import fla.models  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(
            f"model: the gla family needs flash-linear-attention (pip install -e .[gla]): {exc}"
        ) from exc


def _triton_runs() -> bool:
    """Triton needs a GPU driver: without CUDA it has none ("0 active drivers")."""
    return torch.cuda.is_available()


def kernel_paths(hf_config) -> dict[str, str | None]:
    return {
        KERNEL_TRITON: None if _triton_runs() else "fla's Triton kernels need a CUDA GPU",
        KERNEL_REFERENCE: None,
    }


def kernel_path(hf_config) -> str:
    return current_kernel_path(getattr(hf_config, "model_type", "gla"), kernel_paths(hf_config))


def kernel_checks(hf_config, path: str) -> dict:
    if path != KERNEL_TRITON:
        return {}
    from trainer.families import gla_checks

    return gla_checks.checks(hf_config)


def uses_reference_ops(hf_config) -> bool:
    return kernel_path(hf_config) == KERNEL_REFERENCE


def computes_in_fp32(cfg) -> bool:
    """Whether this run's matrix products are fp32 (no mixed precision, fp32 weights)."""
    if cfg.training.mixed_precision != "no":
        return False
    if cfg.model.dtype == "auto":
        return not (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return cfg.model.dtype == "fp32"


# ---------------------------------------------------------------- the reference path


def _swap_to_torch(model, hidden_act: str) -> list[str]:
    """Give every Triton-backed fla module a torch forward (class swap: parameters stay as they are).

    Returns the modules left without a torch version."""
    from fla.layers.gla import GatedLinearAttention
    from fla.modules import FusedRMSNormGated, GatedMLP, RMSNorm

    class TorchRMSNorm(RMSNorm):
        def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
            return _torch_rms_norm(self, x, residual, prenorm, residual_in_fp32)

    class TorchRMSNormGated(FusedRMSNormGated):
        def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
            out = _torch_rms_norm(self, x, residual, prenorm, residual_in_fp32)
            y, summed = out if prenorm else (out, None)
            y = (y.float() * TORCH_ACTIVATIONS[self.activation](g.float())).to(y.dtype)
            return (y, summed) if prenorm else y

    class TorchGatedMLP(GatedMLP):
        def forward(self, x, **kwargs):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    swapped = {RMSNorm: TorchRMSNorm, FusedRMSNormGated: TorchRMSNormGated, GatedMLP: TorchGatedMLP}
    unsupported = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls in swapped and not (cls is GatedMLP and module.hidden_act != "swish"):
            module.__class__ = swapped[cls]
        elif cls is GatedLinearAttention:
            if module.use_short_conv:
                unsupported.append(f"{name}.q_conv1d (use_short_conv)")
            if hasattr(module, "gate_fn"):
                if hidden_act not in TORCH_ACTIVATIONS:
                    unsupported.append(f"{name} (gate activation {hidden_act})")
                module.gate_fn = TORCH_ACTIVATIONS.get(hidden_act, module.gate_fn)
        elif cls.__name__ == "SwiGLULinear":
            continue  # parameterless helper that only the (swapped) GatedMLP's fused forward called
        elif cls.__module__.startswith("fla.") and cls.__module__ != "fla.models.gla.modeling_gla":
            unsupported.append(f"{name} ({cls.__name__})")
    return unsupported


def use_reference_ops() -> None:
    """Point fla's GLA layer at the reference op (process-wide, until ``use_triton_ops``)."""
    import fla.layers.gla as layer

    for name in GLA_OPS:
        setattr(layer, name, naive_gla)


def use_triton_ops() -> None:
    """Point fla's GLA layer back at fla's kernels, wherever an earlier model in this process left it."""
    import fla.layers.gla as layer
    import fla.ops.gla as ops

    for name in GLA_OPS:
        setattr(layer, name, getattr(ops, name))


# ---------------------------------------------------------------- the family


def configure(hf_config, cfg):
    _import_fla()
    fla_tuning.use_tuned_configs()  # before any fla kernel runs, the self-check's included
    # fla's fused SwiGLU reads down_proj.weight directly: a 4-bit or LoRA-wrapped down_proj would be
    # bypassed, so the MLP runs unfused whenever adapters or quantization are involved.
    if cfg.training.method != "full":
        hf_config.fuse_swiglu = False
    if computes_in_fp32(cfg) and getattr(hf_config, "attn_mode", "chunk") == "chunk":
        # chunk_gla's fp32 matrix products run in TF32 (1.2e-3 off fla's fp32 recurrence on an H100), which
        # a 24-layer model turns into LoRA gradients 5-25% apart; fused_recurrent_gla has no matrix products
        # and is exact to fp32 (4e-7). An fp32 run asks for exactness, so it gets that kernel.
        hf_config.attn_mode = "fused_recurrent"
    return hf_config


def _reference_config(config) -> None:
    """What the reference path needs of the model config, refused where it has no torch version."""
    # Fused (linear) cross-entropy is Triton; the loop computes its own loss anyway.
    config.fuse_cross_entropy = False
    config.fuse_linear_cross_entropy = False
    if getattr(config, "attn", None) or getattr(config, "attnres_block_size", None):
        raise ModelLoadError(
            "model: this GLA config mixes in softmax-attention or attnres layers, which have no "
            f"{KERNEL_REFERENCE} path: they need fla's Triton kernels ({KERNEL_TRITON}) on a CUDA GPU"
        )


def load_gla(model_cfg, config, **kwargs):
    from transformers import AutoModelForCausalLM

    _import_fla()
    reference = uses_reference_ops(config)
    if reference:
        _reference_config(config)
    if kwargs.pop("from_config", False):
        model = AutoModelForCausalLM.from_config(config, dtype=kwargs.get("dtype"))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.name_or_path, config=config, revision=model_cfg.revision, **kwargs
        )
    if not reference:
        use_triton_ops()
        return model
    use_reference_ops()
    unsupported = _swap_to_torch(model, model.config.hidden_act)
    if unsupported:
        raise ModelLoadError(
            f"model: GLA modules without a {KERNEL_REFERENCE} path: {', '.join(unsupported[:3])}; they need "
            f"fla's Triton kernels ({KERNEL_TRITON}) on a CUDA GPU"
        )
    return model


def model_inputs(batch: dict) -> dict:
    """Packed rows become one varlen row: ``cu_seqlens`` marks every document (positions restart at 0).

    Rows with padding (no packing) carry an attention mask, which fla unpads into the same varlen form.
    Rows that each hold one document (long documents cut to ``data.max_length``) stay rows: fla's
    fixed-length path computes the same, and reads nothing on the host, so the layers can replay from CUDA
    graphs (``eager_call``).
    """
    if "attention_mask" in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    positions = batch["position_ids"]
    if bool((positions[:, 0] == 0).all()) and int((positions == 0).sum()) == positions.shape[0]:
        return {"input_ids": batch["input_ids"]}
    ids = batch["input_ids"].reshape(1, -1)
    starts = torch.nonzero(positions.reshape(-1) == 0).flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([ids.shape[1]])]).to(torch.int32)
    return {"input_ids": ids, "cu_seqlens": cu_seqlens}


def eager_call(kwargs: dict) -> bool:
    """Varlen calls stay eager: fla reads their chunk layout on the host (``prepare_chunk_indices``), which a
    CUDA graph cannot record; padded rows (an attention mask) are unpadded the same way."""
    return kwargs.get("cu_seqlens") is not None or kwargs.get("attention_mask") is not None


GLA = Family(
    name="gla",
    model_types=MODEL_TYPES["gla"],
    default_lora_targets=["q_proj", "k_proj", "v_proj", "g_proj", "o_proj"],
    packing=True,  # through cu_seqlens, see model_inputs
    load=load_gla,
    model_inputs=model_inputs,
    configure=configure,
    kernel_path=kernel_path,
    kernel_paths=kernel_paths,
    kernel_checks=kernel_checks,
    eager_call=eager_call,
)

register(GLA)
