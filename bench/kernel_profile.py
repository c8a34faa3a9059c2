"""Where a step's GPU time goes: torch.profiler over a few steps, kernel time summed by category.

Shared by ``profile_fast_path.py`` (causal LMs) and ``bench_families.py --profile`` (GLA, Mamba), so both
write the same breakdown into their JSON: milliseconds per step by category, the top kernels, the GPU's
busy time and the host's kernel launches per step.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

# First match wins: the family kernels (fla, mamba_ssm) before the generic gemm/elementwise patterns.
CATEGORIES = [
    ("dequant (NF4)", r"dequant|kDequantize"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("loss (CE)", r"cross_entropy|liger_cross|_ce_|log_softmax|nll_loss|element_mul_kernel"),
    ("norm", r"rms_norm|rmsnorm|layer_norm|_rms_"),
    (
        "scan / conv (fla, mamba_ssm)",
        r"chunk_|_chunk|_dqk|causal_conv1d|selective_scan|ssd|state_passing|cumsum",
    ),
    ("rope", r"rope|rotary"),
    ("swiglu / act", r"swiglu|silu|gelu|softplus"),
    ("gemm", r"gemm|sm90_xmma|cutlass|nvjet|cublas|matmul|gemv|splitKreduce"),
    ("copy / cast", r"copy|cast|to_copy|convert|CatArrayBatched|fill"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled"),
]

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile_steps(
    step: Callable[[int], object], steps: int = 2, top: int = 25, trace: str | None = None
) -> dict:
    """Run ``step(i)`` for ``steps`` steps under torch.profiler; the breakdown per step (ms), as a dict.
    ``trace``: also write the Chrome trace there, gzipped."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    by_category: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    events = prof.key_averages()
    for event in events:
        if event.device_type.name != "CUDA":  # kernels only; CPU ops would count their kernels twice
            continue
        ms = event.self_device_time_total / 1000 / steps
        by_category[category(event.key)] += ms
        by_kernel[event.key[:90]] += ms
    cpu_ops = [e for e in events if e.device_type.name == "CPU"]
    if trace:
        _write_trace(prof, trace)
    return {
        "profile_ms_per_step": {
            k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": {k: round(v, 2) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]},
        "gpu_busy_ms": round(sum(by_category.values()), 1),
        "kernel_launches_per_step": sum(e.count for e in cpu_ops if e.key in LAUNCHES) // steps,
        "top_cpu_self_ms": {
            e.key[:60]: round(e.self_cpu_time_total / 1000 / steps, 2)
            for e in sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[:15]
        },
    }


def _write_trace(prof, path: str) -> None:
    import gzip
    import os
    import shutil

    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
