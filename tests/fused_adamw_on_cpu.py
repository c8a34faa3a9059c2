"""Test-only entry point: ``python -m tests.fused_adamw_on_cpu <trainer args>`` runs the trainer with the fused
AdamW that CUDA runs build, forced on a CPU: it skips a non-finite step on the device, so each step's figures are
copied behind the update and read a step late (trainer/training/figures.py), in every process of a gloo run.
At exit each process prints how many updates left that decision to the device, for a test to see the path."""

from __future__ import annotations

import atexit
import sys

from trainer.cli import main
from trainer.training import loop, optim

_build = optim._build
optim._build = lambda groups, kwargs, name, on_cuda, fused: _build(groups, kwargs, name, on_cuda, True)

_skips_on_device = loop.skips_on_device
decided_on_device = []


def _counted(optimizer, cfg):
    inner = _skips_on_device(optimizer, cfg)
    decided_on_device.append(inner is not None)
    return inner


loop.skips_on_device = _counted
atexit.register(
    lambda: print(f"updates decided on the device: {sum(decided_on_device)}/{len(decided_on_device)}")
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
