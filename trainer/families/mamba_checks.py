"""The Mamba family's start-up self-check: one mixer on a fast path against transformers' PyTorch mixer.

Which kernels a Mamba mixer calls depends on the path and on transformers' version (Mamba-1 trains through
``mamba_inner_fn``, Mamba-2 through ``mamba_split_conv1d_scan_combined`` on mamba_ssm, through fla's scan
and convolution on ``fla-triton-ssd``), so the check runs the mixer itself rather than one op: a single
layer of the model's own sizes, in training mode, on random input of the run's compute dtype, bound to the
path's kernels (``mamba.kernels_of``; a 16-bit dtype in each way the loop runs it: 16-bit weights without
autocast, and under autocast over 16-bit or fp32 weights), against the same
layer in fp32 on transformers' PyTorch functions (``mamba.reference_kernels``), output and every gradient (input and each parameter) compared as
trainer/kernelcheck.py does. Mamba-2 runs one and a half of its chunks, so the state passed
between chunks is exercised.
"""

from __future__ import annotations

import copy

import torch

from trainer.kernelcheck import compare

MAMBA1_TOKENS = 128
MAX_TOKENS = 512


def tokens(hf_config) -> int:
    chunk = getattr(hf_config, "chunk_size", None)
    if hf_config.model_type != "mamba2" or not chunk:
        return MAMBA1_TOKENS
    return min(chunk + chunk // 2, MAX_TOKENS)


# How the loop may run a 16-bit compute dtype: (the weights' dtype, autocast on), the weights' dtype None for
# the compute dtype itself. ``training.mixed_precision: no`` with 16-bit weights (``model.dtype`` bf16, or
# ``auto`` on a GPU) runs without autocast; mixed precision runs under it, over fp32 or 16-bit weights.
REGIMES_16BIT = ((None, False), (None, True), (torch.float32, True))


def check_mixer(device, dtype, hf_config, mixer_class, on_path, on_reference, mambapy: bool = False) -> float:
    """One mixer on the path's kernels (``on_path()``) against the same mixer in fp32 on transformers'
    PyTorch functions (``on_reference()``); the family passes both switches in (trainer/families/mamba.py).

    A 16-bit dtype is checked in each way the loop may run it (``REGIMES_16BIT``): a path that works only
    under autocast (mambapy's scan once did: fp32 states times 16-bit C) fails here, not at step one."""
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = 1
    if hf_config.model_type == "mamba":
        config.use_mambapy = False  # the reference: transformers' sequential scan
    reference = mixer_class(config, layer_idx=0).to(device).train()
    names = [name for name, _ in reference.named_parameters()]
    x0 = torch.randn(1, tokens(hf_config), config.hidden_size, device=device) * 0.5

    def reference_output(x, *values):
        with on_reference():
            return torch.func.functional_call(reference, dict(zip(names, values)), (x,))

    errors = []
    for weights, autocast in REGIMES_16BIT if dtype != torch.float32 else ((None, False),):
        mixer = copy.deepcopy(reference).to(weights or dtype)
        if mambapy:
            mixer.use_mambapy = True
        params = [p.detach().clone().requires_grad_(True) for p in mixer.parameters()]
        x = x0.to(weights or dtype).requires_grad_(True)
        with on_path(), torch.autocast(device.type, dtype=dtype, enabled=autocast):
            out = torch.func.functional_call(mixer, dict(zip(names, params)), (x,))
        errors.append(compare(out, reference_output, [x, *params]))
    return max(errors)
