"""Which kernel path a run trains on: ``model.kernel_path``, a fast path checked against its reference first.

A family lists its paths, best first, with why each cannot run here (``Family.kernel_paths``: GLA
``fla-triton``, ``fla-naive-torch``; Mamba ``mamba_ssm``, ``fla-triton-ssd``, ``mambapy``,
``torch-reference``; causal LMs ``transformers``). On a GPU, before the model is built, a path's kernels run
one tiny forward and backward against the family's reference (``Family.kernel_checks``, measured by
trainer/kernelcheck.py in the run's compute dtype; cached per process, device, model config and
library versions). ``auto`` takes the first path that can run here and passes; one that fails is left, with
a loud one-line warning, for the next (a reference path has nothing to check). A forced path that cannot
run here, or fails its check, stops the run before training (``KernelPathUnavailable``, exit 2), as
``performance.fast_path: on`` does for the causal fast path.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import torch

from trainer import kernelcheck
from trainer.families import Family, ModelLoadError


class KernelPathUnavailable(ModelLoadError):
    """``model.kernel_path`` named a path this model does not have, cannot run here, or that failed."""


@dataclass(frozen=True)
class KernelChoice:
    path: str
    checks: tuple = ()  # kernelcheck.KernelCheck of every path tried, in the order tried
    seconds: float = 0.0  # the self-checks' wall time (on a fresh machine mostly Triton compiling, tuning)


def self_check_runs_on(device: torch.device) -> bool:
    """The families' fast kernels are CUDA kernels: there is nothing to check elsewhere."""
    return device.type == "cuda"


def _config_key(hf_config) -> str:
    """The model config as a cache key: the checks take their sizes from it."""
    try:
        return json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    except (AttributeError, TypeError):
        return repr(sorted(vars(hf_config).items()))


def _check(family: Family, hf_config, path: str, device, dtype) -> tuple:
    if not self_check_runs_on(device):
        return ()
    checks = family.kernel_checks(hf_config, path)
    if not checks:
        return ()
    key = (family.name, path, _config_key(hf_config))
    return kernelcheck.run(device, dtype, checks, key=key, tolerance=kernelcheck.TRITON_TOLERANCE)


def choose(family: Family, hf_config, forced: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The path this run trains on and the self-check results behind it (see the module's docstring)."""
    model_type = getattr(hf_config, "model_type", "") or family.name
    paths = family.kernel_paths(hf_config)
    if forced == "auto":
        candidates = [path for path, why_not in paths.items() if why_not is None]
    elif forced not in paths:
        raise KernelPathUnavailable(
            f"model.kernel_path: '{forced}' is not a kernel path of {family.name} models ({model_type}); "
            f"expected one of: auto, {', '.join(paths)}"
        )
    elif paths[forced] is not None:
        raise KernelPathUnavailable(f"model.kernel_path: {forced} cannot run here: {paths[forced]}")
    else:
        candidates = [forced]
    results: list = []
    start = time.perf_counter()
    for tried, path in enumerate(candidates):
        found = _check(family, hf_config, path, device, dtype)
        results.extend(found)
        failed = kernelcheck.failures(found)
        if not failed:
            return KernelChoice(path, tuple(results), time.perf_counter() - start)
        reason = kernelcheck.describe_failures(failed)
        if forced != "auto":
            raise KernelPathUnavailable(
                f"model.kernel_path: {path} was forced, but its kernel self-check failed on this device: "
                f"{reason}; set model.kernel_path: auto to train on the next path that passes"
            )
        if tried + 1 == len(candidates):  # cannot happen while every family ends with its reference path
            raise KernelPathUnavailable(
                f"model: no {family.name} kernel path passed its self-check: {reason}"
            )
        print(
            f"WARNING: the {family.name} kernels of {path} FAILED their start-up self-check ({reason}); "
            f"this run trains on {candidates[tried + 1]} instead",
            file=sys.stderr,
            flush=True,
        )
    raise KernelPathUnavailable(f"model: no {family.name} kernel path can run here")  # no candidates at all
