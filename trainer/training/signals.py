"""SIGTERM and SIGINT (preemption, Ctrl-C) ask for a checkpoint and a clean exit at the end of the step."""

from __future__ import annotations

import signal

import torch

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopFlag:
    """Installed for the loop's lifetime; ``restore`` puts the previous handlers back."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> StopFlag:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.signum = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def requested(self, accelerator) -> bool:
        """Every rank must stop at the same step, so the flag is agreed on across processes."""
        flag = torch.tensor(1.0 if self.signum is not None else 0.0, device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, "max")
        if flag > 0 and self.signum is None:
            self.signum = signal.SIGTERM
        return bool(flag > 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "SIGTERM"

    @property
    def exit_code(self) -> int:
        return EXIT_SIGNAL.get(self.signum, 143)
