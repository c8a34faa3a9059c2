"""Mamba-2's fused gated norm (trainer/families/mamba_fast.py) against eager PyTorch, on a CPU or a GPU.

On a CPU fla's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported,
so the test starts a fresh process). Prints one JSON line: the shipped check's error in fp32 (one group and
two) and bf16; the same check on a wrong kernel (the norm before the gate); and a whole transformers Mamba-2
mixer in fp32 with its norm swapped by ``fast_modules``, against the same mixer unswapped: the largest
relative difference of its output and of every gradient.
"""

from __future__ import annotations

import copy
import json

import torch


def norm_before_gate(self, hidden_states, gate=None):
    from fla.modules.norm.layernorm_gated import rmsnorm_fn

    group = self.group_size
    return rmsnorm_fn(hidden_states, self.weight, None, z=gate, eps=self.variance_epsilon, group_size=group,
                      norm_before_gate=True).to(gate.dtype)  # fmt: skip


def mixer_difference(device) -> dict:
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    from trainer.families import mamba

    config = Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, state_size=16, n_groups=2, chunk_size=16,
                          num_hidden_layers=1, expand=2)  # fmt: skip
    torch.manual_seed(0)
    reference = Mamba2Mixer(config, layer_idx=0).to(device).train()
    fast = copy.deepcopy(reference)
    swapped = mamba.fast_modules(fast, mamba.KERNEL_FLA)
    x = torch.randn(2, 24, config.hidden_size, device=device)
    results = {"swapped": swapped}
    outputs = []
    for module in (reference, fast):
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        out.backward(torch.ones_like(out))
        outputs.append([out.detach(), xi.grad] + [p.grad for p in module.parameters()])
    results["max_rel"] = max(
        float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(*outputs, strict=True)
    )
    return results


def main() -> None:
    from trainer.families import mamba_fast

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "fp32-groups2": mamba_fast.check_gated_norm(device, torch.float32),
        "fp32-groups1": mamba_fast.check_gated_norm(device, torch.float32, groups=1),
        "bf16-groups2": mamba_fast.check_gated_norm(device, torch.bfloat16),
        "wrong-kernel": mamba_fast.check_gated_norm(device, torch.float32, kernel=norm_before_gate),
        "mixer": mixer_difference(device),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
