"""A step's loss, gradient norm and counts, read on the host at once or one step late.

Where the host decides whether an update is skipped, it must read both figures before stepping the optimizer.
Where the device decides (``loop.skips_on_device``), nothing the host does next needs them: they are copied to
the host behind the update, and read after the next step's passes are queued. The GPU then goes from one
step's update to the next step's forward without waiting while the host logs and launches (3.9 ms of idle in
each graphed Llama-1B step, bench/RESULTS.md session 31).

With several processes, what every rank must read alike (the step's target and input tokens, its router aux
loss, whether any rank was asked to stop) is reduced with the loss in one collective and read along with it,
so a step has no other sync (``step_counts.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.training.step_counts import CountsRule, StepCounts

SkipRule = Callable[[float, float], "str | None"]  # (loss, grad_norm) -> why the update was skipped, or None


def on_host_order(loss: torch.Tensor, grad_norm: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The loss, the gradient norm and the shared device values in one vector: one copy, one read."""
    parts = [loss.detach().double().reshape(1), grad_norm.detach().double().to(loss.device).reshape(1)]
    if shared is not None:
        parts.append(shared.detach().double())
    return torch.cat(parts)


Read = tuple[float, float, "str | None", StepCounts]  # loss, gradient norm, why skipped, counts


class Figures:
    """The loss, the gradient norm, why the update was skipped (None: it was not) and the step's counts."""

    def __init__(self, values: Read | None = None) -> None:
        self._values = values
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._rule: SkipRule | None = None
        self._counts: CountsRule | None = None

    @classmethod
    def known(cls, loss: float, grad_norm: float, skipped: str | None, counts: StepCounts) -> Figures:
        """Figures the host has read already."""
        return cls((loss, grad_norm, skipped, counts))

    @classmethod
    def behind(
        cls,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        shared: torch.Tensor | None,
        rule: SkipRule,
        counts: CountsRule,
    ) -> Figures:
        """The figures and ``shared`` copied to the host after whatever is queued now (the update), without
        waiting for it; once read, ``rule`` names the skip the device made and ``counts`` the step's counts."""
        figures = cls()
        values = on_host_order(loss, grad_norm, shared)
        if values.is_cuda:
            figures._host = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
            figures._host.copy_(values, non_blocking=True)
            figures._copied = torch.cuda.Event()
            figures._copied.record()
        else:
            figures._host = values
        figures._rule, figures._counts = rule, counts
        return figures

    @property
    def pending(self) -> bool:
        """Not read yet: reading waits for the device until the copy is done, and no longer."""
        return self._values is None

    def read(self) -> Read:
        if self._values is None:
            if self._copied is not None:
                self._copied.synchronize()  # this copy only, not the work queued after it
            loss, grad_norm, *shared = self._host.tolist()
            self._values = (loss, grad_norm, self._rule(loss, grad_norm), self._counts(shared))
            self._host = self._copied = None
        return self._values
