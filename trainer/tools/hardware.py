"""What this machine offers for training: GPUs, CPU, RAM, disk, library versions, missing features,
and recommended starting settings for the GPU memory found (``python -m trainer info``).

Nothing here loads a model or needs a GPU; torch is imported only to ask about CUDA, and optional
packages are looked up by metadata, never imported (importing fla, for one, starts Triton).
The recommendation table ``RULES`` is deliberately small and documented in docs/operations.md.

Over 400 lines on purpose: the probes (GPUs through torch or NVML, CPU, RAM, disk, packages,
features) and the table they feed are one report, read together when a recommendation looks wrong.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Distribution names, as in run.json's ``versions``.
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "flash-linear-attention")
OPTIONAL_PACKAGES = ("triton", "flash-attn", "mamba-ssm", "causal-conv1d", "nvidia-ml-py", "tensorboard")
MODEL_CLASSES = ("7B", "13B", "70B")
SEQUENCES_PER_STEP = 16  # gradient accumulation is chosen to reach about this many sequences per step


@dataclass(frozen=True)
class Rule:
    """One row of the recommendation table: the first row of a model class whose ``min_gib`` fits wins."""

    model: str
    min_gib: float
    method: str
    micro_batch_size: int
    max_length: int
    gradient_checkpointing: bool


# Thresholds sit a little under the nominal card sizes (an "80 GB" card reports about 79 GiB).
# Budget behind them: 4-bit weights take about 0.6 GiB per billion parameters, bf16 about 2;
# the rest goes to activations and the fp32 logits of max_length x micro_batch tokens.
RULES: tuple[Rule, ...] = (
    Rule("7B", 75, "lora", 4, 2048, False),
    Rule("7B", 45, "lora", 4, 2048, True),
    Rule("7B", 38, "lora", 2, 2048, True),
    Rule("7B", 22, "qlora", 2, 2048, True),
    Rule("7B", 15, "qlora", 1, 2048, True),
    Rule("7B", 11, "qlora", 1, 1024, True),
    Rule("7B", 7.5, "qlora", 1, 512, True),
    Rule("13B", 75, "lora", 2, 2048, True),
    Rule("13B", 45, "qlora", 4, 2048, True),
    Rule("13B", 38, "qlora", 2, 2048, True),
    Rule("13B", 22, "qlora", 1, 2048, True),
    Rule("13B", 15, "qlora", 1, 1024, True),
    Rule("13B", 11, "qlora", 1, 512, True),
    Rule("70B", 75, "qlora", 1, 2048, True),
    Rule("70B", 45, "qlora", 1, 1024, True),
)


def recommend(memory_gib: float, compute_capability: str | None = None) -> list[dict]:
    """Starting settings per model class for one GPU of ``memory_gib``; ``fits`` is False below the table."""
    out = []
    for model in MODEL_CLASSES:
        rows = sorted((r for r in RULES if r.model == model), key=lambda r: -r.min_gib)
        rule = next((r for r in rows if memory_gib >= r.min_gib), None)
        if rule is None:
            gpus = fsdp_gpus_needed(model, rows[-1].min_gib, memory_gib)
            shard = (
                f"training.distributed: fsdp across {gpus} such GPUs (QLoRA weights split {gpus} ways)"
                if gpus
                else "more GPUs (training.distributed: fsdp)"
            )
            out.append(
                {
                    "model": model,
                    "fits": False,
                    "fsdp_gpus": gpus,
                    "advice": f"a {model} model does not fit one {memory_gib:.0f} GiB GPU even with QLoRA "
                    f"(needs {rows[-1].min_gib:g} GiB or more): use {shard} or a smaller model",
                }
            )
            continue
        entry = {"fits": True, **asdict(rule)}
        entry["gradient_accumulation_steps"] = max(1, SEQUENCES_PER_STEP // rule.micro_batch_size)
        entry["mixed_precision"] = _mixed_precision(compute_capability)
        entry["overrides"] = overrides(entry)
        out.append(entry)
    return out


QLORA_GIB_PER_BILLION = 0.6  # 4-bit weights with their quantization constants


def fsdp_gpus_needed(model: str, one_gpu_gib: float, memory_gib: float) -> int | None:
    """The fewest GPUs (2, 4 or 8) of ``memory_gib`` that hold a QLoRA ``model`` under FSDP: its 4-bit
    weights divided among them, the rest of the one-GPU budget (activations, adapter, optimizer) on each."""
    weights = float(model.rstrip("B")) * QLORA_GIB_PER_BILLION
    rest = max(one_gpu_gib - weights, 0.0)
    return next((n for n in (2, 4, 8) if weights / n + rest <= memory_gib), None)


def _mixed_precision(compute_capability: str | None) -> str | None:
    if compute_capability is None:
        return None
    return "bf16" if _cc_at_least(compute_capability, 8, 0) else "fp16"


def overrides(entry: dict) -> list[str]:
    """The recommendation as ``--set`` arguments for ``python -m trainer train``."""
    sets = [
        f"training.method={entry['method']}",
        f"training.micro_batch_size={entry['micro_batch_size']}",
        f"training.gradient_accumulation_steps={entry['gradient_accumulation_steps']}",
        f"data.max_length={entry['max_length']}",
        f"memory.gradient_checkpointing={str(entry['gradient_checkpointing']).lower()}",
    ]
    if entry.get("mixed_precision"):
        sets.append(f"training.mixed_precision={entry['mixed_precision']}")
        if entry["method"] == "qlora":
            sets.append(f"quantization.compute_dtype={entry['mixed_precision']}")
    return sets


def _cc_at_least(cc: str | None, major: int, minor: int) -> bool:
    if not cc:
        return False
    try:
        a, b = (int(x) for x in cc.split(".", 1))
    except ValueError:
        return False
    return (a, b) >= (major, minor)


# ---------------------------------------------------------------- gathering


def package_versions(names=PACKAGES + OPTIONAL_PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


def detect_gpus() -> tuple[list[dict], list[str]]:
    """GPUs torch can use (else those the NVIDIA driver sees), and why none is usable when so."""
    gpus: list[dict] = []
    reasons: list[str] = []
    try:
        import torch
    except ImportError:
        torch = None
        reasons.append("torch is not installed")
    if torch is not None:
        hip = getattr(torch.version, "hip", None)
        if torch.version.cuda is None and hip is None:
            reasons.append(
                f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None): "
                "install a CUDA build of torch to train on a GPU"
            )
        elif not torch.cuda.is_available():
            hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
            note = f"; CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None else ""
            reasons.append(
                f"torch {torch.__version__} is built for CUDA {torch.version.cuda or hip}, but "
                f"torch.cuda.is_available() is False (no driver, a driver too old, or no GPU{note})"
            )
        else:
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                gpus.append(
                    _gpu_record(
                        index, props.name, props.total_memory, f"{props.major}.{props.minor}", "torch"
                    )
                )
    nvml_gpus, nvml_reason = _nvml_gpus()
    if nvml_reason:
        reasons.append(nvml_reason)
    if not gpus and nvml_gpus:
        # A driver and GPUs, but a torch that cannot use them: list them so the fix is obvious.
        gpus = [dict(g, usable_by_torch=False) for g in nvml_gpus]
    return gpus, reasons


def _gpu_record(index: int, name: str, total_bytes: int, cc: str | None, source: str) -> dict:
    return {
        "index": index,
        "name": name,
        "memory_total_mb": round(total_bytes / 2**20),
        "memory_gib": round(total_bytes / 2**30, 1),
        "compute_capability": cc,
        "source": source,
        "usable_by_torch": source == "torch",
    }


def _nvml_gpus() -> tuple[list[dict], str | None]:
    from trainer.monitor.telemetry import NvmlUnavailable, close_nvml, open_nvml, text

    try:
        pynvml, handles = open_nvml()
    except NvmlUnavailable as exc:
        return [], str(exc)
    gpus = []
    try:
        for index, handle in enumerate(handles):
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            try:
                cc = "{}.{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except Exception:  # noqa: BLE001 - old drivers do not report it
                cc = None
            gpus.append(_gpu_record(index, text(pynvml.nvmlDeviceGetName(handle)), total, cc, "nvml"))
    except Exception as exc:  # noqa: BLE001
        return gpus, f"NVML could not list the GPUs ({exc})"
    finally:
        close_nvml(pynvml)
    return gpus, None


def cpu_info() -> dict:
    import psutil

    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "model": model,
        "arch": platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": usable,
        "instruction_sets": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
    }


def ram_info() -> dict:
    import psutil

    memory = psutil.virtual_memory()
    return {
        "total_gib": round(memory.total / 2**30, 1),
        "available_gib": round(memory.available / 2**30, 1),
    }


def disk_info(folder: str | os.PathLike) -> dict:
    """Free space where ``folder`` is (or would be created: its nearest existing parent)."""
    requested = Path(folder).expanduser().absolute()
    existing = requested
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    return {
        "path": str(requested),
        "measured_at": str(existing),
        "free_bytes": usage.free,
        "total_bytes": usage.total,
        "free_gib": round(usage.free / 2**30, 1),
        "total_gib": round(usage.total / 2**30, 1),
    }


def features(gpus: list[dict], versions: dict[str, str | None]) -> list[dict]:
    """Each optional capability, whether this machine has it, and why not."""
    usable = [g for g in gpus if g.get("usable_by_torch")]
    has_gpu = bool(usable)
    ampere = has_gpu and all(_cc_at_least(g["compute_capability"], 8, 0) for g in usable)
    no_gpu = "needs a CUDA GPU usable by torch (none found; see gpu_unavailable_reasons)"
    out = []

    def add(name: str, ok: bool, why_not: str, note: str = "") -> None:
        out.append({"name": name, "available": bool(ok), "reason": note if ok else why_not})

    add("gpu_training", has_gpu, no_gpu, f"{len(usable)} GPU(s)")
    add("multi_gpu", len(usable) > 1, "needs 2 or more GPUs", "accelerate launch uses all local GPUs")
    add(
        "bf16_mixed_precision",
        ampere,
        no_gpu if not has_gpu else "needs compute capability 8.0+ (Ampere or newer); use fp16",
    )
    add("fp16_mixed_precision", has_gpu, no_gpu)
    add("tf32_matmul", ampere, no_gpu if not has_gpu else "needs compute capability 8.0+")
    if versions.get("bitsandbytes") is None:
        add("qlora_4bit", False, "bitsandbytes is not installed (pip install -e .[train])")
    else:
        add(
            "qlora_4bit",
            True,
            "",
            "bitsandbytes 4-bit on GPU"
            if has_gpu
            else "bitsandbytes CPU backend: works, but slow (testing only)",
        )
    add(
        "bnb_8bit_and_paged_optimizers",
        has_gpu and versions.get("bitsandbytes") is not None,
        "adamw_8bit / paged_adamw_* need bitsandbytes and a CUDA GPU (paging uses CUDA unified memory); "
        "use optimization.optimizer: adamw",
    )
    fla_missing = [p for p in ("flash-linear-attention", "triton") if versions.get(p) is None]
    add(
        "fla_triton_kernels",
        has_gpu and not fla_missing,
        f"{' and '.join(fla_missing)} not installed" if fla_missing else no_gpu,
        "GLA family trains with fla's fused kernels",
    )
    mamba_missing = [p for p in ("mamba-ssm", "causal-conv1d") if versions.get(p) is None]
    add(
        "mamba_fast_kernels",
        has_gpu and not mamba_missing,
        (f"{' and '.join(mamba_missing)} not installed" if mamba_missing else no_gpu)
        + "; transformers falls back to its slow sequential Mamba path",
    )
    add(
        "flash_attention_2",
        ampere and versions.get("flash-attn") is not None,
        "flash-attn not installed" if versions.get("flash-attn") is None else "needs a GPU with compute 8.0+",
        "model.attn_implementation: flash_attention_2",
    )
    add(
        "gpu_telemetry",
        has_gpu and versions.get("nvidia-ml-py") is not None,
        "needs nvidia-ml-py and an NVIDIA driver; telemetry samples CPU and RAM only",
    )
    return out


CPU_ONLY_ADVICE = (
    "no usable GPU: train only tiny models here (configs/tiny-*: method lora, mixed_precision no, "
    "optimizer adamw); a 7B model needs a GPU with 8 GiB or more (see the table in docs/operations.md)"
)


def gather(output_dir: str | os.PathLike = "runs") -> dict:
    """Everything ``info`` prints, as one JSON-ready dict."""
    gpus, reasons = detect_gpus()
    versions = package_versions()
    recommendations = []
    seen = set()
    for gpu in gpus:
        key = (gpu["memory_gib"], gpu["compute_capability"])
        if key in seen:
            continue
        seen.add(key)
        recommendations.append(
            {
                "gpu": gpu["name"],
                "memory_gib": gpu["memory_gib"],
                "compute_capability": gpu["compute_capability"],
                "settings": recommend(gpu["memory_gib"], gpu["compute_capability"]),
            }
        )
    usable = any(g.get("usable_by_torch") for g in gpus)
    return {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "gpus": gpus,
        "gpu_unavailable_reasons": [] if usable else reasons,
        "cpu": cpu_info(),
        "ram": ram_info(),
        "disk": disk_info(output_dir),
        "versions": versions,
        "features": features(gpus, versions),
        "recommendations": recommendations,
        "cpu_only_advice": None if usable else CPU_ONLY_ADVICE,
    }


def format_text(info: dict) -> str:
    """The human-readable ``info`` page."""
    lines = [f"host: {info['host']}  python {info['python']}  {info['platform']}"]
    if info["gpus"]:
        for g in info["gpus"]:
            usable = "" if g["usable_by_torch"] else "  (NOT usable by this torch)"
            lines.append(
                f"gpu {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability "
                f"{g['compute_capability'] or '?'}{usable}"
            )
    else:
        lines.append("gpu: none")
    lines += [f"  why: {r}" for r in info["gpu_unavailable_reasons"]]
    c, r, d = info["cpu"], info["ram"], info["disk"]
    lines.append(
        f"cpu: {c['model']} ({c['arch']}), {c['logical_cores']} logical / {c['physical_cores']} physical "
        f"cores, {c['usable_cores']} usable; {' '.join(c['instruction_sets']) or 'no AVX2'}"
    )
    lines.append(f"ram: {r['total_gib']} GiB total, {r['available_gib']} GiB available")
    lines.append(
        f"disk: {d['free_gib']} GiB free of {d['total_gib']} GiB at {d['measured_at']}"
        + ("" if d["measured_at"] == d["path"] else f" (for {d['path']}, not created yet)")
    )
    lines.append("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in info["versions"].items()))
    lines.append("features:")
    for f in info["features"]:
        mark = "yes" if f["available"] else "NO "
        lines.append(f"  [{mark}] {f['name']}" + (f": {f['reason']}" if f["reason"] else ""))
    if info["cpu_only_advice"]:
        lines.append(f"recommended: {info['cpu_only_advice']}")
    for rec in info["recommendations"]:
        lines.append(f"recommended starting settings for {rec['gpu']} ({rec['memory_gib']} GiB):")
        for s in rec["settings"]:
            if not s["fits"]:
                lines.append(f"  {s['model']:>4}: {s['advice']}")
                continue
            lines.append(
                f"  {s['model']:>4}: {s['method']}, micro-batch {s['micro_batch_size']} x accumulation "
                f"{s['gradient_accumulation_steps']}, max_length {s['max_length']}, gradient checkpointing "
                f"{'on' if s['gradient_checkpointing'] else 'off'}"
            )
            lines.append("        " + " ".join(f"--set {o}" for o in s["overrides"]))
    return "\n".join(lines)
