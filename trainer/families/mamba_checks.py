"""The Mamba family's start-up self-check: one mixer on a fast path against transformers' PyTorch mixer.

Which kernels a Mamba mixer calls depends on the path and on transformers' version (Mamba-1 trains through
``mamba_inner_fn``, Mamba-2 through ``mamba_split_conv1d_scan_combined`` on mamba_ssm, through fla's scan
and convolution on ``fla-triton-ssd``), so the check runs the mixer itself rather than one op: a single
layer of the model's own sizes, in training mode, on random input of the run's compute dtype, bound to the
path's kernels (``mamba.kernels_of``; under autocast in 16 bits, as the loop runs it), against the same
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


def check_mixer(device, dtype, hf_config, mixer_class, on_path, on_reference, mambapy: bool = False) -> float:
    """One mixer on the path's kernels (``on_path()``) against the same mixer in fp32 on transformers'
    PyTorch functions (``on_reference()``); the family passes both switches in (trainer/families/mamba.py)."""
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = 1
    if hf_config.model_type == "mamba":
        config.use_mambapy = False  # the reference: transformers' sequential scan
    reference = mixer_class(config, layer_idx=0).to(device).train()
    mixer = copy.deepcopy(reference).to(dtype)
    if mambapy:
        mixer.use_mambapy = True
    names = [name for name, _ in reference.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in mixer.parameters()]
    x = (torch.randn(1, tokens(hf_config), config.hidden_size, device=device) * 0.5).to(dtype)
    x.requires_grad_(True)
    # Under autocast as the loop runs a 16-bit run (accelerate's mixed precision): mambapy's scan, for one,
    # mixes fp32 states with 16-bit weights in a matmul that only autocast makes work.
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with on_path(), autocast:
        out = torch.func.functional_call(mixer, dict(zip(names, params)), (x,))

    def reference_output(x, *values):
        with on_reference():
            return torch.func.functional_call(reference, dict(zip(names, values)), (x,))

    return compare(out, reference_output, [x, *params])
