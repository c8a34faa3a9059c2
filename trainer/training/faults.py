"""Fault injection: where a test may break a run on purpose, passed to ``train()`` as an object.

Production code runs with ``NO_FAULTS``, whose hooks do nothing; tests pass a subclass (see
``tests/faults.py``) instead of setting environment variables that production code would read.
"""

from __future__ import annotations


class Faults:
    """The hooks; each is called at one fixed point of a run."""

    def oom(self, phase: str, step: int) -> None:
        """Before a training step ("train"), an evaluation ("eval") or a planner trial ("plan"): may raise
        ``torch.OutOfMemoryError`` to exercise the fallback on a machine without a GPU."""

    def loss(self, loss_fn):
        """Once at set-up: may wrap the micro-batch loss (a NaN, an exception at a chosen call)."""
        return loss_fn

    def during_save(self, name: str) -> None:
        """Half-way through writing checkpoint ``name`` (weights written, trainer_state.json not yet):
        may end the process the way SIGKILL would."""


NO_FAULTS = Faults()
