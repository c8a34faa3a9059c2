"""A step's loss and gradient norm, read on the host at once or one step late.

Where the host decides whether an update is skipped, it must read both figures before stepping the optimizer.
Where the device decides (``loop.skips_on_device``), nothing the host does next needs them: they are copied to
the host behind the update, and a one-process run reads them after the next step's passes are queued. The GPU
then goes from one step's update to the next step's forward without waiting while the host logs and launches
(3.9 ms of idle in each graphed Llama-1B step, bench/RESULTS.md session 31).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SkipRule = Callable[[float, float], "str | None"]  # (loss, grad_norm) -> why the update was skipped, or None


class Figures:
    """The loss, the gradient norm and why the update was skipped (None: it was not)."""

    def __init__(self, values: tuple[float, float, str | None] | None = None) -> None:
        self._values = values
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._rule: SkipRule | None = None

    @classmethod
    def known(cls, loss: float, grad_norm: float, skipped: str | None) -> Figures:
        """Figures the host has read already."""
        return cls((loss, grad_norm, skipped))

    @classmethod
    def behind(cls, loss: torch.Tensor, grad_norm: torch.Tensor, rule: SkipRule) -> Figures:
        """Both figures copied to the host after whatever is queued now (the update), without waiting for it;
        ``rule`` names the skip the device made, once they are read."""
        figures = cls()
        both = torch.stack([loss.detach().float(), grad_norm.detach().float().to(loss.device)])
        if both.is_cuda:
            figures._host = torch.empty(2, pin_memory=True)
            figures._host.copy_(both, non_blocking=True)
            figures._copied = torch.cuda.Event()
            figures._copied.record()
        else:
            figures._host = both
        figures._rule = rule
        return figures

    @property
    def pending(self) -> bool:
        """Not read yet: reading waits for the device until the copy is done, and no longer."""
        return self._values is None

    def read(self) -> tuple[float, float, str | None]:
        if self._values is None:
            if self._copied is not None:
                self._copied.synchronize()  # this copy only, not the work queued after it
            loss, grad_norm = self._host.tolist()
            self._values = (loss, grad_norm, self._rule(loss, grad_norm))
            self._host = self._copied = None
        return self._values
