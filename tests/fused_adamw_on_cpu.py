"""Test-only entry point: ``python -m tests.fused_adamw_on_cpu <trainer args>`` runs the trainer with the fused
AdamW that CUDA runs build, forced on a CPU: it skips a non-finite step on the device, so each step's figures are
copied behind the update and read a step late (trainer/training/figures.py), in every process of a gloo run."""

from __future__ import annotations

import sys

from trainer.cli import main
from trainer.training import optim

_build = optim._build
optim._build = lambda groups, kwargs, name, on_cuda, fused: _build(groups, kwargs, name, on_cuda, True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
