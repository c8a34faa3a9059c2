"""Build the model to train: family, tokenizer, 4-bit loading, PEFT adapters, and a size report.

Errors a user can cause (missing folder, missing weights, no tokenizer, offline hub id) become a
``ModelLoadError`` naming the file, instead of a deep stack trace.
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import fastpath, peft_methods
from trainer.config import Config
from trainer.families import Family, ModelLoadError, family_for
from trainer.families.base import kernel_path_chosen
from trainer.fastpath import attention as fast_attention
from trainer.model import chunked_loss, kernel_choice
from trainer.model.sharded_loading import ShardedLoad
from trainer.moe_quant import QuantizedExpertWeights, quantize_fused_experts
from trainer.monitor.experts import find_routers

log = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    family: Family
    model_type: str
    report: dict
    shards: ShardedLoad | None = None  # sharded loading: filled in after accelerate shards the model


def is_local(name_or_path: str) -> bool:
    return Path(name_or_path).expanduser().exists() or name_or_path.startswith((".", "/", "~"))


def check_local_folder(path: Path, random_init: bool) -> None:
    """Name the missing file before transformers raises something vaguer."""
    if not path.is_dir():
        raise ModelLoadError(f"model.name_or_path: folder not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.name_or_path: {path / 'config.json'} is missing")
    if random_init:
        return
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        raise ModelLoadError(
            f"model.name_or_path: no weights in {path} (expected one of {', '.join(WEIGHT_FILES)}; "
            "or set model.random_init: true to train from the config alone)"
        )
    for index_name in (n for n in present if n.endswith(".index.json")):
        shards = set(json.loads((path / index_name).read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelLoadError(
                f"model.name_or_path: weight shard missing: {path / missing[0]} (named in {index_name})"
            )


def load_hf_config(cfg: Config):
    from transformers import AutoConfig

    from trainer.families.extras import require_installed

    require_installed(
        cfg
    )  # every verb that loads a model: the pip command, not transformers' "not recognized"
    name = cfg.model.name_or_path
    if is_local(name):
        check_local_folder(Path(name).expanduser(), cfg.model.random_init)

    def read():
        return AutoConfig.from_pretrained(
            name,
            revision=cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
            cache_dir=cfg.paths.cache_dir,
        )

    try:
        try:
            return read()
        except ValueError:
            # An unknown model_type may be one a family registers on import (fla's gla); importing fla
            # costs seconds, so only then.
            if not _import_family_registrations():
                raise
            return read()
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"model.name_or_path: cannot load config for '{name}': {first_line}") from exc


def _import_family_registrations() -> bool:
    """Some families register their model_type with the Auto classes on import (fla's gla)."""
    try:
        import fla  # noqa: F401
    except Exception:  # noqa: BLE001 - optional dependency, absent or broken: causal models still load
        return False
    return True


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source,
            revision=cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
            cache_dir=cfg.paths.cache_dir,
        )
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"model.tokenizer: no usable tokenizer in '{source}' (expected tokenizer.json or tokenizer files; "
            "set model.tokenizer to another folder)"
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def resolve_dtype(cfg: Config) -> torch.dtype:
    if cfg.model.dtype != "auto":
        return DTYPES[cfg.model.dtype]
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def quantization_config(cfg: Config, family_skip: tuple[str, ...] = ()):
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    skip = list(q.skip_modules) + [name for name in family_skip if name not in q.skip_modules]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
        bnb_4bit_quant_storage=quant_storage(cfg),
        llm_int8_skip_modules=skip,
    )


def quant_storage(cfg: Config) -> torch.dtype:
    """The dtype packed 4-bit weights are stored in: bytes, except under FSDP, which shards only floating
    tensors and casts every weight of a layer alike: there the compute dtype (as Answer.AI's FSDP-QLoRA),
    or bf16 under bf16 mixed precision, whose policy casts every weight it gathers to bf16 (packed bytes
    stored as fp32 would be converted as numbers)."""
    if cfg.training.distributed == "fsdp":
        if cfg.training.mixed_precision == "bf16":
            return torch.bfloat16
        return DTYPES[cfg.quantization.compute_dtype]
    return torch.uint8


def cuda_index(device: torch.device) -> int:
    """accelerate's single-GPU device is plain ``cuda`` (no index); bitsandbytes' device_map needs one."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sharded_loading(cfg: Config) -> ShardedLoad | None:
    """QLoRA, LoRA and full fine-tuning under FSDP with ``fsdp.cpu_ram_efficient_loading`` on several
    processes: each rank keeps only its shard of every weight while loading (trainer/model/sharded_loading.py;
    the optimizer finds the sharded parameters by name, trainer/training/fsdp.py ``remap_optimizer``)."""
    if not (cfg.training.distributed == "fsdp" and cfg.fsdp.cpu_ram_efficient_loading):
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    q = cfg.quantization
    expert_quant = (q.quant_type, q.double_quant, quant_storage(cfg)) if q.quantize_experts else None
    return ShardedLoad(dist.get_rank(), dist.get_world_size(), expert_quant)


def load_base_model(cfg: Config, family: Family, hf_config, device: torch.device, shards=None):
    """Load (or random-init) the base model; 4-bit goes through from_pretrained so bitsandbytes quantizes.
    With ``shards`` every weight read from the checkpoint is cut to this rank's shard as it loads."""
    dtype = resolve_dtype(cfg)
    qlora = cfg.training.method == "qlora"
    kwargs = {"dtype": dtype, "cache_dir": cfg.paths.cache_dir}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    torch.manual_seed(cfg.training.seed)
    if cfg.model.random_init and not qlora:
        return family.load(cfg.model, hf_config, from_config=True, dtype=dtype)
    if qlora:
        kwargs["quantization_config"] = quantization_config(cfg, family.quantization_skip(hf_config, cfg))
        kwargs["device_map"] = {"": cuda_index(device) if device.type == "cuda" else "cpu"}
    if cfg.model.random_init:
        # bitsandbytes quantizes while loading weights, so random weights take a detour through disk.
        with tempfile.TemporaryDirectory(prefix="init-model-") as tmp:
            save_random_init(family.load(cfg.model, hf_config, from_config=True, dtype=dtype), tmp)
            local = type(cfg.model)(**{**cfg.model.__dict__, "name_or_path": tmp, "revision": None})
            with shards.capture() if shards else nullcontext():
                return family.load(local, hf_config, **kwargs)
    try:
        with shards.capture() if shards else nullcontext():
            return family.load(cfg.model, hf_config, **kwargs)
    except OSError as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ModelLoadError(
            f"model.name_or_path: cannot load weights of '{cfg.model.name_or_path}': {first_line}"
        ) from exc


def save_random_init(model: torch.nn.Module, folder: str) -> None:
    """Config and weights into ``folder`` on every rank: save_pretrained writes on rank 0 only once
    torch.distributed is up, and each rank reads its own temporary folder back."""
    from safetensors.torch import save_model

    model.config.save_pretrained(folder)
    save_model(model, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def disable_cpu_bf16_repack(model: torch.nn.Module) -> int:
    """bitsandbytes on AVX512-BF16 CPUs repacks 4-bit weights on the first no-grad forward into a layout
    with no backward, silently corrupting LoRA gradients afterwards (platform notes). Turn it off."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def lora_targets(cfg: Config, family: Family, hf_config):
    """The configured targets, else the family's defaults (which may depend on the kernel path)."""
    targets = cfg.lora.target_modules
    if targets is not None:
        return targets
    defaults = family.default_lora_targets
    return defaults(hf_config) if callable(defaults) else defaults


NEEDS_FULL_PRECISION_INIT = ("pissa", "olora")


def check_lora_config(cfg: Config, family: Family, hf_config) -> None:
    """LoRA settings PEFT or the family would fail on mid-load (or, worse, train silently wrong),
    refused with one line before any weights load."""
    lo = cfg.lora
    if lo.variant not in family.lora_variants:
        raise ModelLoadError(
            f"lora.variant: '{lo.variant}' is not supported for the {family.name} family "
            f"(have: {', '.join(family.lora_variants)})"
        )
    if cfg.training.method == "qlora" and lo.init.startswith(NEEDS_FULL_PRECISION_INIT):
        raise ModelLoadError(
            f"lora.init: {lo.init} factorises the base weights, which training.method qlora keeps in 4-bit; "
            "use training.method lora, or lora.init default or gaussian"
        )
    family.check_lora(cfg, hf_config, lora_targets(cfg, family, hf_config))
    peft_methods.check(cfg, family, hf_config)


def apply_peft(model, cfg: Config, family: Family, upcast_for_kbit: bool = True):
    """LoRA on ``model``. QLoRA's usual preparation upcasts every 16-bit parameter to fp32; the CUDA fast
    path (``upcast_for_kbit=False``) keeps them 16-bit, as its fused kernels accumulate in fp32 anyway, and
    so does FSDP: its mixed precision casts every weight back to bf16 when it gathers it, so an fp32 copy
    of the embeddings and head would only double their shards, and the MoE experts' packed 4-bit bytes,
    stored as bf16 parameters there, would be converted as if they were numbers."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.training.method == "qlora" and not upcast_for_kbit:
        model.requires_grad_(False)
        if cfg.memory.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.training.method == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.memory.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    if cfg.lora.variant not in family.lora_variants:
        raise ModelLoadError(
            f"lora.variant: '{cfg.lora.variant}' is not supported for the {family.name} family"
        )
    # LoRA-GA's init needs the data: trainer.peft_methods.prepare sets it once the loop has rows.
    init = cfg.lora.init if cfg.lora.init != "lora_ga" else "default"
    peft_config = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_targets(cfg, family, model.config),
        target_parameters=cfg.lora.target_parameters,
        bias=cfg.lora.bias,
        use_dora=cfg.lora.variant == "dora",
        use_rslora=cfg.lora.variant == "rslora",
        init_lora_weights=True if init == "default" else init,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_config)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"lora.target_modules: {str(exc).splitlines()[0]}") from exc


def size_report(model: torch.nn.Module, method: str) -> dict:
    """Parameter counts and the bytes left in 16/32-bit, experts separately: fused 3-D expert
    parameters escape bitsandbytes' Linear replacement (bitsandbytes issue 1849)."""
    try:
        import bitsandbytes as bnb

        params4 = bnb.nn.Params4bit
    except ImportError:
        params4 = ()
    total = trainable = quantized = unquantized_bytes = expert_bytes = 0
    packed_experts = set()  # FSDP's floating storage of packed experts: counted once, as 4-bit
    for module in model.modules():
        if isinstance(module, QuantizedExpertWeights):
            total += module.numel()
            quantized += module.numel()
            packed_experts.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in packed_experts:
            continue
        is_4bit = bool(params4) and isinstance(param, params4)
        # two 4-bit values per stored byte, whatever dtype stores them (FSDP: the compute dtype)
        count = param.numel() * param.element_size() * 2 if is_4bit else param.numel()
        total += count
        if param.requires_grad:
            trainable += count
        if is_4bit:
            quantized += count
            continue
        nbytes = param.numel() * param.element_size()
        unquantized_bytes += nbytes
        if param.dim() == 3 and "expert" in name:
            expert_bytes += nbytes
    return {
        "method": method,
        "total_params": total,
        "trainable_params": trainable,
        "quantized_params": quantized,
        "unquantized_bytes": unquantized_bytes,
        "unquantized_expert_bytes": expert_bytes,
    }


def _processes() -> int:
    """How many processes train this run (1 before torch.distributed is set up, or without it)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def load_for_training(cfg: Config, device: torch.device) -> LoadedModel:
    hf_config = load_hf_config(cfg)
    model_type = getattr(hf_config, "model_type", "") or ""
    family = family_for(model_type, cfg.model.family)
    tokenizer = load_tokenizer(cfg)
    if cfg.training.method == "qlora" and not family.quantizable:
        raise ModelLoadError(f"training.method: qlora is not available for the {family.name} family")
    hf_config = family.configure(hf_config, cfg)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        cfg.training.mixed_precision
    ) or resolve_dtype(cfg)
    # Before anything path-dependent: LoRA defaults, 4-bit skips and the model itself follow the choice.
    choice = kernel_choice.choose(family, hf_config, cfg.model.kernel_path, device, compute)
    with kernel_path_chosen(model_type, choice.path):
        model, report, shards = _build(cfg, family, hf_config, device, compute, choice)
    return LoadedModel(
        model=model, tokenizer=tokenizer, family=family, model_type=model_type, report=report, shards=shards
    )


def _kernel_line(family: Family, model_type: str, choice: kernel_choice.KernelChoice) -> str:
    line = f"kernels: {family.name}/{model_type} runs on {choice.path}"
    if choice.checks:
        errors = ", ".join(f"{c.kernel} {c.error:.1e}{'' if c.passed else ' FAILED'}" for c in choice.checks)
        line += f" (self-check in {choice.seconds:.1f} s, relative error: {errors})"
    return line


def family_graphs_unavailable(cfg: Config, family: Family, device, checked: bool) -> str | None:
    """Why a GLA or Mamba run's layers are not replayed from CUDA graphs (``fastpath.graphs_unavailable``):
    only families whose layers say which calls a graph cannot record (``Family.eager_call``), and only on
    their self-checked GPU kernels (``checked``), the fast path's place for these families."""
    if family.eager_call is None:
        if cfg.performance.cuda_graphs == "on":
            raise fastpath.FastPathUnavailable(
                f"performance.cuda_graphs: on, but the {family.name} family's layers are not graphed"
            )
        return f"the {family.name} family's layers are not graphed"
    checkpointing = cfg.memory.gradient_checkpointing
    processes = _processes()
    return fastpath.graphs_unavailable(
        cfg.performance.cuda_graphs, device, False, processes, checked, checkpointing, cfg.data.packing,
        cfg.grads_synced_after_step(processes),
    )  # fmt: skip


def qlora_upcast(cfg: Config, keeps_16bit: bool) -> bool:
    """Whether QLoRA's 16-bit parameters go to fp32: ``quantization.upcast``, auto following the path."""
    mode = cfg.quantization.upcast
    return mode == "on" or (mode == "auto" and not keeps_16bit)


def keeps_16bit_under_qlora(family: Family, hf_config, kernel_path: str, device, fast) -> bool:
    """Whether QLoRA skips ``prepare_model_for_kbit_training``'s fp32 upcast of every 16-bit parameter.

    The upcast suits eager maths (the reference paths). The causal fast path, and the GLA and Mamba families'
    own GPU kernels (a path with start-up checks: fla's Triton, mamba_ssm), take bf16 weights as the LoRA runs
    on them do and accumulate in fp32 inside; fed fp32 norms, convolutions and out_proj they go down their
    fp32 variants instead (on an H100, Mamba-2 QLoRA on mamba_ssm did not finish 10 steps in 120 s, where the
    same model's LoRA run, bf16 throughout, took under 100 s with its autotuning)."""
    if fast.enabled:
        return True
    own_kernels = family.name != "causal" and bool(family.kernel_checks(hf_config, kernel_path))
    return own_kernels and torch.device(device).type == "cuda"


def family_fast_path(cfg: Config, family: Family, hf_config, kernel_path: str, device, compute, choice):
    """A GLA or Mamba run's fast path (fused LoRA projections and loss, the family's own module swaps) rides
    on its sequence-mixing kernels: only on a path that has a self-check and passed it, never on a reference
    path. Its ``self_check`` lists the family's kernel checks, then the fast path's own."""
    mode = cfg.performance.fast_path
    if mode == "off":
        return fastpath.Decision(False, "performance.fast_path: off", choice.checks)
    if not family.fast_path:
        # GLA-340M on an H100: the step is host-bound (143 of ~290 ms on the GPU), and the fused LoRA nodes
        # and loss gave no tokens/s over fla's own modules (56.7k against 60.1k, same call); chunked loss
        # (memory.chunked_loss) keeps its memory saving.
        reason = f"the {family.name} family runs its own kernels ({kernel_path})"
    elif torch.device(device).type != "cuda" or not family.kernel_checks(hf_config, kernel_path):
        reason = f"the {family.name} family runs its reference kernels here ({kernel_path})"
    else:
        reason = None
    if reason is not None:
        if mode == "on":
            raise fastpath.FastPathUnavailable(f"performance.fast_path: on, but {reason}")
        return fastpath.Decision(False, reason, choice.checks)
    checks = fastpath.family_checks(cfg.training.method, family.fast_checks(hf_config, kernel_path))
    decided = fastpath.decide(mode, device, compute, checks)
    return fastpath.Decision(decided.enabled, decided.reason, tuple(choice.checks) + decided.checks)


def _build(cfg: Config, family: Family, hf_config, device, compute, choice):
    """The model on the chosen kernel path, with adapters and the fast path where they apply; its report,
    and what sharded loading kept for the shards (None when it does not apply)."""
    model_type = getattr(hf_config, "model_type", "") or ""
    if cfg.training.method in ("lora", "qlora"):
        check_lora_config(cfg, family, hf_config)
    kernel_path = family.kernel_path(hf_config)
    sharded = cfg.training.distributed == "fsdp"
    print(_kernel_line(family, model_type, choice), flush=True)
    if cfg.training.distributed == "fsdp" and family.name != "causal":
        raise ModelLoadError(
            f"training.distributed: fsdp is not available for the {family.name} family (its own kernels "
            "read whole weights); use ddp"
        )
    if family.name == "causal":
        fast = fastpath.decide(cfg.performance.fast_path, device, compute)
    else:
        fast = family_fast_path(cfg, family, hf_config, kernel_path, device, compute, choice)
    shards = sharded_loading(cfg)
    if shards is not None and cfg.lora.target_parameters and not cfg.quantization.quantize_experts:
        raise ModelLoadError(
            "lora.target_parameters: LoRA on fused expert weights reads them whole, which "
            "fsdp.cpu_ram_efficient_loading keeps sharded; set one of them to null/false"
        )
    model = load_base_model(cfg, family, hf_config, device, shards)
    if cfg.training.method == "qlora" and cfg.quantization.quantize_experts:
        if cfg.lora.target_parameters:
            raise ModelLoadError(
                "lora.target_parameters: the fused expert weights are 4-bit (quantization.quantize_experts: true); "
                "set it to false to put LoRA on experts"
            )
        quantize_fused_experts(
            model, cfg.quantization.quant_type, cfg.quantization.double_quant, quant_storage(cfg), shards
        )
    disable_cpu_bf16_repack(model)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if cfg.memory.gradient_checkpointing and cfg.training.method != "qlora":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.training.method == "lora":
            model.enable_input_require_grads()
    if cfg.training.method in ("lora", "qlora"):
        # Under FSDP the frozen weights keep the dtype they were loaded in (apply_peft says why).
        upcast = qlora_upcast(
            cfg, sharded or keeps_16bit_under_qlora(family, hf_config, kernel_path, device, fast)
        )
        model = apply_peft(model, cfg, family, upcast_for_kbit=upcast)
    if shards is not None:
        shards.to_meta(model)  # true shapes, no bytes: fully_shard cuts them, the kept chunks fill them
    report = size_report(model, cfg.training.method)
    checkpointing = cfg.memory.gradient_checkpointing
    offload = checkpointing and cfg.memory.offload_checkpoints
    if family.name == "causal":
        offload = offload and cfg.training.method in ("lora", "qlora") and not sharded
        processes = _processes()
        graphs_off = fastpath.graphs_unavailable(
            cfg.performance.cuda_graphs, device, offload, processes, fast.enabled, checkpointing,
            cfg.data.packing, cfg.grads_synced_after_step(processes), bool(find_routers(model)),
        )  # fmt: skip
        fast_report = fastpath.apply(model, fast, offload=offload, graphs_off=graphs_off)
    else:
        checked = torch.device(device).type == "cuda" and bool(family.kernel_checks(hf_config, kernel_path))
        graphs_off = family_graphs_unavailable(cfg, family, device, checked)
        fast_report = fastpath.apply_to_family(
            model, fast, lambda m: family.fast_modules(m, kernel_path), graphs_off, family.eager_call
        )
    report["fast_path"] = fast_report.as_dict()
    if fast_report.enabled and family.name == "causal":
        report.update(fast_attention.apply(model, device, cfg.data.packing, cfg.model.attn_implementation))
        print(f"fast path: {fast_report.as_dict()}, attention {report['attention']}", flush=True)
    elif fast_report.enabled:
        shown = ("fused_loss", "lora_modules_fused", "rms_norm", "family_modules")
        summary = {k: v for k, v in fast_report.as_dict().items() if k in shown}
        print(f"fast path: {summary}", flush=True)
    fused = fast_report.fused_loss
    report["chunked_loss"] = chunked_loss.enable(model, cfg.memory.chunked_loss and not fused)
    report["kernel_path"] = kernel_path
    report["kernel_check_s"] = round(choice.seconds, 2)
    return model, report, shards
