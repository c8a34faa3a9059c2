"""SIGTERM and SIGINT (preemption, Ctrl-C): a checkpoint and a clean exit (143/130) within seconds.

A run spends time in three kinds of places, and a signal is honoured differently in each:

- **Set-up** (loading the model, preparing data, LoRA-GA/SDLoRA's one-off work): nothing new exists to save,
  so the handler raises ``Stopped`` at once, wherever the signal lands; the loop exits without a checkpoint.
  Work that must not be cut in the middle (writing a file in place) runs inside ``deferred()`` and polls
  ``should_stop()`` between its pieces; leaving the block raises ``Stopped`` if a signal came meanwhile.
- **The loop**: the handler only records the signal. After each step the ranks agree on it
  (``requested``) and save a checkpoint of that step. With several processes each rank's say rides in the
  all-reduce of a step's loss and is read with it (``step_counts.py``), where a step's figures are read a step
  late, after the next step: a signal stops the run within two steps instead of one.
- **Evaluation and generation**: the same agreement between batches (``check``), so an evaluation of
  thousands of rows stops within one batch; ``check`` raises ``Stopped`` on every rank at the same batch,
  the loop marks the evaluation pending (redone on resume) and saves the step.
"""

from __future__ import annotations

import contextlib
import os
import signal

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}

_installed: StopFlag | None = None  # the flag of the run in progress in this process, if any


class Stopped(BaseException):
    """A stop was requested: raised during set-up at once, and at the agreed checks of an evaluation.

    A BaseException, as KeyboardInterrupt is, so that no library's ``except Exception`` swallows it."""

    def __init__(self, signum: int | None = None):
        self.signum = signum
        super().__init__(signal.Signals(signum).name if signum else "stop requested")


def should_stop() -> bool:
    """True once SIGTERM or SIGINT reached this process while a run is in progress here.

    For long work that can give up between pieces (data preparation inside ``deferred()``). It is this
    process's view only: code that runs collectives must agree first (``StopFlag.requested``)."""
    return _installed is not None and _installed.signum is not None


@contextlib.contextmanager
def deferred():
    """Within the block a signal only sets the flag (poll ``should_stop()``); afterwards, during set-up,
    a recorded signal raises ``Stopped``. Outside a run (no flag installed) it does nothing."""
    flag = _installed
    if flag is None:
        yield
        return
    flag._deferred += 1
    try:
        yield
    finally:
        flag._deferred -= 1
    if flag.immediate and flag.signum is not None and not flag._deferred:
        raise Stopped(flag.signum)


class StopFlag:
    """Installed for the run's lifetime; ``restore`` puts the previous handlers back.

    ``immediate`` (set-up) until the loop turns it off once there is a training state worth saving."""

    def __init__(self):
        self.signum: int | None = None
        self.agreed = False  # the ranks have agreed to stop (the same on every rank)
        self.immediate = True
        self._deferred = 0
        self._previous = {}
        self._pid: int | None = None  # the process that installed it; forked children are not the run

    def install(self) -> StopFlag:
        global _installed
        self._pid = os.getpid()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        _installed = self
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked worker (data preparation's pool): end as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.signum = signum
        if self.immediate and not self._deferred:
            raise Stopped(signum)

    def restore(self) -> None:
        global _installed
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if _installed is self:
            _installed = None

    @property
    def asked(self) -> bool:
        """This process has had a signal (the others may not have)."""
        return self.signum is not None

    def requested(self, accelerator, agreed: bool | None = None) -> bool:
        """Every rank must stop at the same point, so the flag is agreed on across processes: ``agreed`` is a
        flag all ranks reduced already (with a step's loss, ``step_counts.py``) and read at the same point;
        without it, a collective agrees now."""
        if accelerator.num_processes == 1:
            return self.signum is not None
        if agreed is None:
            import torch

            flag = torch.tensor(1.0 if self.signum is not None else 0.0, device=accelerator.device)
            agreed = bool(accelerator.reduce(flag, "max") > 0)
        # Once agreed (an evaluation's check, say), it holds: a flag reduced before that may not know of it yet.
        self.agreed = self.agreed or agreed
        if self.agreed and self.signum is None:
            self.signum = signal.SIGTERM
        return self.agreed

    def check(self, accelerator) -> None:
        """Between evaluation or generation batches: raise ``Stopped`` on every rank once any rank has a signal.

        Every rank must call it equally often (pad with calls where a rank has fewer batches)."""
        if self.requested(accelerator):
            raise Stopped(self.signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "SIGTERM"

    @property
    def exit_code(self) -> int:
        return EXIT_SIGNAL.get(self.signum, 143)
