"""Fault injectors for tests, passed to ``train(faults=...)`` or, in a subprocess, through
``python -m tests.faulty_trainer`` (production code reads no test switches from the environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from tests.helpers import REPO, trainer_env
from trainer.training.faults import Faults


class InjectedFaults(Faults):
    """``oom="train:3,eval:4"`` raises a fake CUDA OOM once at each (phase, step) pair (a pair listed twice
    fires twice: the first retry fails too; ``train:3@1`` on rank 1 of several processes only); ``crash_during_save="checkpoint-8"`` dies like SIGKILL (exit
    137) half-way through that save; ``wrap_loss`` wraps the run's micro-batch loss."""

    def __init__(self, oom: str = "", crash_during_save: str | None = None, wrap_loss=None):
        self.pending: Counter = Counter()
        rank = int(os.environ.get("RANK", "0"))
        for item in filter(None, (part.strip() for part in oom.split(","))):
            phase, step = item.split(":")
            step, _, only_rank = step.partition("@")  # "train:3@1": on rank 1 only
            if not only_rank or int(only_rank) == rank:
                self.pending[(phase, int(step))] += 1
        self.crash_during_save = crash_during_save
        self.wrap_loss = wrap_loss

    def oom(self, phase: str, step: int) -> None:
        if self.pending[(phase, step)] > 0:
            self.pending[(phase, step)] -= 1
            if phase == "train":  # raised in the step's first forward, after its collectives, as a real one
                self.armed = f"CUDA out of memory (injected for testing at {phase} step {step})"
                return
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected for testing at {phase} step {step})")

    armed: str | None = None

    def loss(self, loss_fn):
        loss_fn = self.wrap_loss(loss_fn) if self.wrap_loss else loss_fn

        def maybe_out_of_memory(*args, **kwargs):
            if self.armed:
                message, self.armed = self.armed, None
                raise torch.OutOfMemoryError(message)
            return loss_fn(*args, **kwargs)

        return maybe_out_of_memory

    def during_save(self, name: str) -> None:
        if name == self.crash_during_save:
            os._exit(137)


def run_with_faults(
    *args: str, oom: str = "", crash_during_save: str | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python -m trainer <args>`` in a subprocess, with these faults injected."""
    flags = ["--oom", oom] + (["--crash-during-save", crash_during_save] if crash_during_save else [])
    return subprocess.run(
        [sys.executable, "-m", "tests.faulty_trainer", *flags, *args],
        env=trainer_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
