"""Mamba (Mamba-1) and Mamba-2 through transformers, on the fastest kernels this machine has.

Kernel paths, best first (the ``model_report`` event records which one ran, as ``kernel_path``; on a GPU the
first that can run here and passes its start-up self-check, trainer/families/mamba_checks.py, unless
``model.kernel_path`` names one):

- ``mamba_ssm``: transformers found the compiled mamba_ssm and causal_conv1d packages (CUDA only).
- ``fla-triton-ssd`` (Mamba-2, CUDA, no mamba_ssm or mamba_ssm failed its check): the SSD scan is a
  scalar-gated linear attention, so it runs as flash-linear-attention's Triton ``chunk_simple_gla``, the
  short convolution as fla's Triton ``causal_conv1d``. No compiled extension is needed: fla and triton
  are pure-Python wheels. On Hopper with triton >= 3.4, < 3.7.1 the scan's gated backward kernel is the
  kit's corrected copy (trainer/families/fla_gated_dqk.py), which fla refuses to run its own of there.
  The scan runs in fp32 (``fla_ssd_scan``): fla's gate gradient does not survive 16-bit inputs.
- ``mambapy`` (Mamba-1 without mamba_ssm): the mambapy package's parallel scan, pure PyTorch, about
  15x faster than the sequential reference loop on a CPU, where transformers' mixer trains through it
  (``_mambapy_trains``: transformers 5.24 does, after its ``mamba_inner_fn`` finds no mamba_ssm); its
  read-out runs in fp32, which makes 16-bit weights without autocast train (``_readout_in_fp32``).
- ``torch-reference``: transformers' PyTorch code. Fine for tests on a CPU; on a GPU it is slow and,
  for Mamba-2, memory-hungry, so a GPU run on it prints a loud warning.

Mamba ignores ``position_ids`` and its reference kernels cannot take sequence boundaries, so this
family turns packing off: one document (or chunk of one) per row, right-padded, with an attention mask.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import math
import sys

import torch
import torch.nn.functional as F

from trainer.families import mamba_fast, register
from trainer.families.base import Family, ModelLoadError, current_kernel_path
from trainer.families.extras import MODEL_TYPES

KERNEL_MAMBA_SSM = "mamba_ssm"
KERNEL_FLA = "fla-triton-ssd"
KERNEL_MAMBAPY = "mambapy"
KERNEL_REFERENCE = "torch-reference"

# PEFT refuses LoRA on these (mixer weights read directly by the kernels).
PEFT_REFUSED = ("out_proj", "conv1d")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _importable(name: str) -> bool:
    """Whether ``import name`` works. A failed mamba_ssm build can leave the package without its compiled
    library; transformers then quietly keeps its PyTorch code, so finding the package is not enough."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA/ABI error raised while loading the library
        return False


# The module-level functions of transformers' Mamba-2 that the fla path replaces.
FLA_SWAPPED = ("mamba2_chunk_scan", "causal_conv1d_fn")


def _fla_usable() -> bool:
    """fla's kernels import, and this transformers' Mamba-2 mixer calls the functions we would swap
    (another layout would silently keep the reference path while claiming the fast one)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
        from transformers.models.mamba2 import modeling_mamba2
    except Exception:  # noqa: BLE001 - fla or triton missing or broken: not this path
        return False
    called = inspect.unwrap(modeling_mamba2.Mamba2Mixer.forward).__code__.co_names
    return all(hasattr(modeling_mamba2, name) and name in called for name in FLA_SWAPPED)


def _mambapy_trains() -> bool:
    """Whether this transformers' Mamba-1 mixer trains through mambapy (where mamba_ssm does not run).

    Before 5.2x the training forward called the selective scan, which takes ``use_mambapy``. From 5.2x it
    calls ``mamba_inner_fn`` first: a hub-kernel wrapper that returns mamba_ssm's fused output where mamba_ssm
    runs and None elsewhere, and the forward then falls through (``fused_output``) to the same scan with
    ``use_mambapy``. tests/families/test_mamba.py checks this against the mixer itself (pscan is called)."""
    try:
        from transformers.models.mamba import modeling_mamba
    except ImportError:
        return False
    code = inspect.unwrap(modeling_mamba.MambaMixer.forward).__code__
    if "mamba_inner_fn" not in code.co_names:
        return True
    return "fused_output" in code.co_varnames and "mamba_selective_scan" in code.co_names


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def kernel_paths(hf_config) -> dict[str, str | None]:
    """This model type's paths, best first, each with why it cannot run here (None: it can)."""
    cuda = _cuda_available()
    paths = {
        KERNEL_MAMBA_SSM: None
        if cuda and _importable("causal_conv1d") and _importable("mamba_ssm")
        else "needs a CUDA GPU with mamba_ssm and causal_conv1d importable (pip install -e .[mamba-kernels])"
    }
    if hf_config.model_type == "mamba2":
        paths[KERNEL_FLA] = (
            None if cuda and _fla_usable() else "needs a CUDA GPU with flash-linear-attention and triton"
        )
    else:
        paths[KERNEL_MAMBAPY] = (
            None
            if _installed("mambapy") and _mambapy_trains()
            else "needs mambapy and a transformers whose Mamba mixer trains through it"
        )
    paths[KERNEL_REFERENCE] = None
    return paths


def auto_kernel_path(hf_config) -> str:
    """The best path this machine has, whatever this run chose (``kernel_path``)."""
    return next(path for path, why_not in kernel_paths(hf_config).items() if why_not is None)


def kernel_path(hf_config) -> str:
    return current_kernel_path(hf_config.model_type, kernel_paths(hf_config))


# The start-up check of each fast path: the function that carries its training step, as the report names it.
CHECK_NAMES = {
    ("mamba", KERNEL_MAMBA_SSM): "mamba_inner_fn",
    ("mamba2", KERNEL_MAMBA_SSM): "mamba_split_conv1d_scan_combined",
    ("mamba2", KERNEL_FLA): "fla_ssd_scan+causal_conv1d",
    ("mamba", KERNEL_MAMBAPY): "mambapy_pscan",
    ("mamba2", KERNEL_MAMBAPY): "mambapy_pscan",
}


def kernel_checks(hf_config, path: str) -> dict:
    """One mixer on ``path`` against transformers' PyTorch mixer (trainer/families/mamba_checks.py)."""
    model_type = hf_config.model_type
    name = CHECK_NAMES.get((model_type, path))
    if name is None:
        return {}
    from trainer.families import mamba_checks

    check = functools.partial(
        mamba_checks.check_mixer,
        hf_config=hf_config,
        mixer_class=_modeling(model_type)[1],
        on_path=functools.partial(kernels_of, model_type, path),
        on_reference=functools.partial(reference_kernels, model_type),
        mambapy=path == KERNEL_MAMBAPY,
    )
    return {name: check}


# ---------------------------------------------------------------- Mamba-2 on fla's Triton kernels


def fla_ssd_scan(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    cu_seqlens=None,
    op=None,
    **_,
):
    """transformers' ``mamba2_chunk_scan`` (same arguments and result) as a simple-GLA call.

    SSD: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t + D x_t. That is linear attention
    with q = C, k = B, v = dt x, a per-head log-decay g = dt A and scale 1; the state layout
    [heads, head_dim, state] is fla's ``state_v_first``. ``op`` defaults to fla's chunk kernel.
    """
    if op is None:
        from fla.ops.simple_gla import chunk_simple_gla as op
    heads, groups = hidden_states.shape[2], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or not math.isinf(hi):
        dt = dt.clamp(min=lo, max=hi)
    # The scan runs in fp32 whatever the model's dtype. fla derives the gate's gradient (dt's, through
    # g = dt A: dt_bias and A_log) as sum(dq q) - sum(dk k), a difference of near-equal sums; from 16-bit
    # q, k, v it came out 2-14x off (relative) on an H200, with fla's own kernel and the kit's alike, while
    # every other gradient was within 2%. In fp32 (TF32 products) it is within 1%.
    # Each cast before its copy or product (a 16-bit [tokens, heads, state] intermediate would be written, read
    # and, in the backward, reduced and cast back: ~10% of a 130M model's step on an H100).
    q = C.float().repeat_interleave(heads // groups, dim=2)
    k = B.float().repeat_interleave(heads // groups, dim=2)
    dt = dt.float()
    v = hidden_states * dt[..., None]  # promoted to fp32 in the product itself
    g = dt * A.float()
    o, final = op(
        q=q,
        k=k,
        v=v,
        g=g,
        scale=1.0,
        initial_state=initial_states,
        output_final_state=return_final_states,
        state_v_first=True,
        cu_seqlens=cu_seqlens,
    )
    o = o.float()
    if D is not None:
        o = torch.addcmul(o, hidden_states, D.float()[:, None])  # o + D x, in fp32, one kernel
    return (o, final) if return_final_states else o


def fla_causal_conv1d(hidden_states, weight, bias=None, activation=None, cu_seqlens=None, **_):
    """transformers' ``causal_conv1d_fn`` ([batch, channels, time] in and out) on fla's Triton kernel."""
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(
        x=hidden_states.transpose(1, 2).contiguous(),
        weight=weight,
        bias=bias,
        activation=activation,
        cu_seqlens=cu_seqlens,
    )
    return out.transpose(1, 2)


# transformers' own binding of each module function this family rebinds, by (module name, function name), so
# that reference_kernels and use_kernel_path can put it back.
_REPLACED: dict[tuple[str, str], object] = {}


def use_fla_kernels() -> None:
    """Point transformers' Mamba-2 mixer at the fla functions above (CUDA only, process-wide). Where fla
    refuses its own gated backward (Hopper, triton >= 3.4, < 3.7.1: fla #640), the kit's corrected copy of
    that one kernel takes those calls (trainer/families/fla_gated_dqk.py); the self-check still judges."""
    from transformers.models.mamba2 import modeling_mamba2

    from trainer.families import fla_gated_dqk, fla_tuning

    fla_tuning.use_tuned_configs()
    if fla_gated_dqk.affected():
        fla_gated_dqk.register()
    for name, fast in zip(FLA_SWAPPED, (fla_ssd_scan, fla_causal_conv1d)):
        _REPLACED.setdefault((modeling_mamba2.__name__, name), getattr(modeling_mamba2, name))
        setattr(modeling_mamba2, name, fast)


# The Mamba-1 function the mambapy path rebinds (trainer/families/mamba.py ``use_mambapy_scan``).
MAMBAPY_SWAPPED = "mamba_selective_scan"


def _readout_in_fp32(scan):
    """transformers' selective scan, with its mambapy branch's read-out ``all_states @ C`` in one dtype.

    That branch builds its states in fp32 (``discrete_A``, ``deltaB_u`` are upcast) and multiplies them by C,
    which comes out of x_proj in the weights' dtype. Under autocast the matmul casts both to 16 bits, which is
    why the start-up check (run under autocast) passed; a run with 16-bit weights and no mixed precision
    (``training.mixed_precision: no`` with ``model.dtype`` bf16, or ``auto`` on a GPU: the tiny configs) has
    no autocast, and the matmul raised ``expected scalar type Float but found BFloat16`` at the first step.
    Here C is read out in fp32, as the states are; the mixer casts the result back to its dtype before
    out_proj. The sequential branch (``use_mambapy`` off) casts the state to C's dtype itself."""

    @functools.wraps(scan)
    def selective_scan(hidden_states, dt, A, B, C, *args, **kwargs):
        if kwargs.get("use_mambapy"):
            C = C.float()
        return scan(hidden_states, dt, A, B, C, *args, **kwargs)

    return selective_scan


def use_mambapy_scan() -> None:
    """Point transformers' Mamba-1 mixer at its PyTorch selective scan with an fp32 read-out (process-wide)."""
    from transformers.models.mamba import modeling_mamba

    native = _REPLACED.setdefault(
        (modeling_mamba.__name__, MAMBAPY_SWAPPED), getattr(modeling_mamba, MAMBAPY_SWAPPED)
    )
    setattr(modeling_mamba, MAMBAPY_SWAPPED, _readout_in_fp32(inspect.unwrap(native)))


def _modeling(model_type: str):
    """transformers' modeling module and mixer class for this Mamba generation."""
    if model_type == "mamba2":
        from transformers.models.mamba2 import modeling_mamba2

        return modeling_mamba2, modeling_mamba2.Mamba2Mixer
    from transformers.models.mamba import modeling_mamba

    return modeling_mamba, modeling_mamba.MambaMixer


def _mixer_calls(model_type: str) -> list[str]:
    """The global names the mixer's methods use (its kernel functions among them)."""
    _, mixer = _modeling(model_type)
    called = set()
    for method in vars(mixer).values():
        if inspect.isfunction(method):
            called.update(inspect.unwrap(method).__code__.co_names)
    return sorted(called)


def use_kernel_path(model_type: str, path: str) -> None:
    """Bind transformers' mixer module to ``path`` (process-wide, until the next call): ``mamba_ssm``
    transformers' own bindings (its kernels, where it found them); any other path its PyTorch functions,
    which ``fla-triton-ssd`` then partly replaces with fla's, and ``mambapy`` (Mamba-1) with its scan read out
    in fp32 (``_readout_in_fp32``). So a run moved off mamba_ssm by a failed
    self-check, or by ``model.kernel_path``, cannot reach mamba_ssm's kernels any more."""
    module, _ = _modeling(model_type)
    for name in _mixer_calls(model_type):
        native = _REPLACED.get((module.__name__, name), getattr(module, name, None))
        if not inspect.isfunction(native):
            continue
        target = native if path == KERNEL_MAMBA_SSM else inspect.unwrap(native)
        if getattr(module, name) is not target:
            _REPLACED.setdefault((module.__name__, name), native)
            setattr(module, name, target)
    if path == KERNEL_FLA:
        use_fla_kernels()
    if path == KERNEL_MAMBAPY and model_type == "mamba":
        use_mambapy_scan()


@contextlib.contextmanager
def kernels_of(model_type: str, path: str):
    """The mixer module bound to ``path`` inside this block (the self-check), then as it was."""
    module, _ = _modeling(model_type)
    saved = {name: getattr(module, name) for name in _mixer_calls(model_type) if hasattr(module, name)}
    use_kernel_path(model_type, path)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def reference_kernels(model_type: str):
    """Run the mixer on transformers' own PyTorch code inside this block, whatever kernels it found.

    transformers binds mamba_ssm's and causal_conv1d's functions when it imports the modeling module,
    wrapping its PyTorch versions (``functools.wraps``, so ``__wrapped__``). For baselines on the same
    card and for checking a fast path against the reference; process-wide while it lasts.
    """
    module, _ = _modeling(model_type)
    saved = {}
    for name in _mixer_calls(model_type):
        current = getattr(module, name, None)
        original = _REPLACED.get((module.__name__, name), current)
        if inspect.isfunction(original) and hasattr(original, "__wrapped__"):
            saved[name] = current
            setattr(module, name, inspect.unwrap(original))
    try:
        yield sorted(saved)
    finally:
        for name, current in saved.items():
            setattr(module, name, current)


# ---------------------------------------------------------------- the family


def _transformers_classes(model_type: str):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    if model_type == "mamba2":
        return Mamba2Config, Mamba2ForCausalLM
    return MambaConfig, MambaForCausalLM


def configure(hf_config, cfg):
    # `import fla` registers fla's own Mamba classes for these model types with the Auto classes;
    # this family trains transformers' implementation, so it reads config.json with its class.
    config_cls, _ = _transformers_classes(hf_config.model_type)
    if type(hf_config) is not config_cls:
        hf_config = config_cls.from_pretrained(
            cfg.model.name_or_path, revision=cfg.model.revision, cache_dir=cfg.paths.cache_dir
        )
    path = auto_kernel_path(hf_config)  # what this machine offers; the run's own choice comes after
    if torch.cuda.is_available() and path in (KERNEL_REFERENCE, KERNEL_MAMBAPY):
        print(
            f"WARNING: {hf_config.model_type} is training on a GPU WITHOUT fast kernels ({path}); expect it "
            "to be many times slower and, for Mamba-2, far hungrier for memory. Install mamba-ssm and "
            "causal-conv1d (or, for Mamba-2, flash-linear-attention with triton).",
            file=sys.stderr,
            flush=True,
        )
    return hf_config


def load_mamba(model_cfg, config, **kwargs):
    _, model_cls = _transformers_classes(config.model_type)
    path = kernel_path(config)
    use_kernel_path(config.model_type, path)
    if config.model_type == "mamba":
        # mambapy's scan on its own path; on torch-reference only where this transformers' training forward
        # never reaches it (then it still speeds up evaluation), so that path stays the sequential reference.
        config.use_mambapy = path == KERNEL_MAMBAPY or (
            path == KERNEL_REFERENCE and _installed("mambapy") and not _mambapy_trains()
        )
    if kwargs.pop("from_config", False):
        return model_cls._from_config(config, dtype=kwargs.get("dtype"))
    return model_cls.from_pretrained(
        model_cfg.name_or_path, config=config, revision=model_cfg.revision, **kwargs
    )


def quantization_skip(hf_config, cfg) -> tuple[str, ...]:
    """Modules whose weight a kernel reads directly: a 4-bit copy there breaks the forward pass."""
    fused = kernel_path(hf_config) == KERNEL_MAMBA_SSM
    if hf_config.model_type == "mamba":
        # The reference path computes dt_proj.weight @ x itself; mamba_inner_fn also reads x_proj and out_proj.
        # SDLoRA's BC trains entries of x_proj's weight, which 4-bit storage cannot hold.
        lora = getattr(cfg, "lora", None)
        sdlora_bc = lora is not None and lora.method == "sdlora" and "BC" in (lora.sdlora_params or ("BC",))
        if fused:
            return ("dt_proj", "x_proj", "out_proj")
        return ("dt_proj", "x_proj") if sdlora_bc else ("dt_proj",)
    return ("out_proj",) if fused else ()


def default_lora_targets(hf_config) -> list[str]:
    """in_proj; for Mamba-1 x_proj too, unless mamba_ssm's fused kernel reads x_proj's weight directly."""
    if hf_config.model_type == "mamba" and kernel_path(hf_config) != KERNEL_MAMBA_SSM:
        return ["in_proj", "x_proj"]
    return ["in_proj"]


def check_lora(cfg, hf_config, targets) -> None:
    if not isinstance(targets, (list, tuple)):
        if targets == "all-linear":
            raise ModelLoadError(
                "lora.target_modules: all-linear would include out_proj, which PEFT refuses for Mamba; "
                f"list modules instead (default: {', '.join(default_lora_targets(hf_config))})"
            )
        return
    refused = [t for t in targets if t in PEFT_REFUSED]
    if refused:
        raise ModelLoadError(
            f"lora.target_modules: {', '.join(refused)} cannot take LoRA in Mamba models (PEFT refuses "
            "out_proj and conv1d); use in_proj (and x_proj for Mamba-1)"
        )
    direct = ["dt_proj"] if hf_config.model_type == "mamba" else []
    if hf_config.model_type == "mamba" and kernel_path(hf_config) == KERNEL_MAMBA_SSM:
        direct.append("x_proj")  # mamba_inner_fn reads it directly too
    ignored = [t for t in targets if t in direct]
    if ignored:
        raise ModelLoadError(
            f"lora.target_modules: {', '.join(ignored)} would get no gradient here (the kernel reads its "
            "weight directly, bypassing LoRA); use in_proj"
        )


def fast_checks(hf_config, path: str) -> dict:
    """The family's own fast-path checks: Mamba-2's gated norm on fla's kernel, on the fla path only."""
    return mamba_fast.gated_norm_checks(hf_config) if path == KERNEL_FLA else {}


def fast_modules(model, path: str) -> dict:
    """The family's own fast-path swaps (fla-triton-ssd only: mamba_ssm's training forward fuses the norm)."""
    return mamba_fast.use_fused_gated_norm(model) if path == KERNEL_FLA else {}


def model_inputs(batch: dict) -> dict:
    """Mamba takes no position ids; padding (packing is off) is masked out of the state. A mask without
    padding is left out: the mixer would multiply its input and its convolution's output by it (twice per
    layer, and again in the backward) to change nothing."""
    keys = ["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        keys.append("attention_mask")
    return {k: batch[k] for k in keys if k in batch}


MAMBA = Family(
    name="mamba",
    model_types=MODEL_TYPES["mamba"],
    default_lora_targets=default_lora_targets,
    packing=False,
    load=load_mamba,
    model_inputs=model_inputs,
    configure=configure,
    kernel_path=kernel_path,
    kernel_paths=kernel_paths,
    kernel_checks=kernel_checks,
    quantization_skip=quantization_skip,
    check_lora=check_lora,
    fast_path=True,
    fast_checks=fast_checks,
    fast_modules=fast_modules,
)

register(MAMBA)
