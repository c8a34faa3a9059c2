"""What each optimizer step leaves behind: its training_log.jsonl record, expert usage, the progress bar.

A step's counts arrive with its figures (``step_counts.py``); expert counts are a collective, run on every rank
at the same steps, whatever rank 0 writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trainer import runfolder
from trainer.config import Config
from trainer.data.batches import Position
from trainer.fastpath.layer_graphs import CudaGraphs
from trainer.training.checkpointing import LoopState
from trainer.training.figures import Figures
from trainer.training.step_counts import StepCounts
from trainer.training.trackers import Trackers


class PeakMemory:
    """Peak GPU memory since the last record (the allocator's counter is reset at each), or the process's RSS
    on CPU.

    On a GPU it adds what CUDA graphs' pools hold and the allocator's peak does not count (their replays'
    transient tensors), as it stood at the last reset: during the interval in which a graph is captured, its
    transient tensors are allocated and counted already, so adding them then would count them twice."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.unseen_bytes = CudaGraphs.unseen_bytes_now() if device.type == "cuda" else 0

    def read_mb(self) -> float:
        if self.device.type != "cuda":
            import psutil

            return round(psutil.Process().memory_info().rss / 2**20, 1)
        peak = (CudaGraphs.take_allocated_peak(self.device) + self.unseen_bytes) / 2**20
        self.unseen_bytes = CudaGraphs.unseen_bytes_now()
        return round(peak, 1)


def make_progress(enabled: bool, step: int, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


@dataclass
class StepDone:
    """One step's update, as its record needs it; its figures may still be on their way to the host."""

    step: int
    pos: Position  # where the data stood after the step
    lr: float
    started: float  # time.time() when its passes began
    figures: Figures


class StepLog:
    """Writes one step's record every ``logging.interval`` steps and expert usage every ``expert_interval``.

    A step whose figures were left to read late (``figures.py``) is held until ``flush``: the loop calls it once
    the next step's passes are queued, before anything that reads or saves what the step left, and at the end.
    """

    def __init__(
        self, cfg: Config, log: runfolder.RunLog, accelerator, counter, trackers: Trackers, notifier,
        total_steps: int, train_rows: int, state: LoopState,
    ):  # fmt: skip
        self.cfg, self.log, self.accelerator = cfg, log, accelerator
        self.counter, self.trackers, self.notifier, self.state = counter, trackers, notifier, state
        self.peak_memory = PeakMemory(accelerator.device)
        self.total_steps, self.train_rows = total_steps, train_rows
        self.progress = make_progress(
            accelerator.is_main_process and cfg.logging.progress_bar, state.step, total_steps
        )
        self.expert_window_start = state.step + 1
        self.train_start = time.time()
        self.last_reported = 0.0
        self.step_time_ema: float | None = None
        self.held: StepDone | None = None
        self.agreed_stop: bool | None = None  # the stop flag all ranks reduced with the last step reported

    def finish(self, done: StepDone, read_now: bool) -> None:
        """Report ``done`` now, or, where its figures are still on their way and ``read_now`` is False, at the
        next ``flush``."""
        self.flush()
        self.held = done
        if read_now or not done.figures.pending:
            self.flush()

    def flush(self) -> None:
        """Report the held step, if any: its skip, its loss as the run's latest, the heartbeat, its record."""
        done, self.held = self.held, None
        if done is None:
            return
        loss, grad_norm, skipped, counts = done.figures.read()
        self.agreed_stop = counts.stop
        now = time.time()
        # From the step before's report where that came later than this step's start (it was read late): in
        # steady state, the time between two steps' figures, which is what a step takes.
        seconds = now - max(done.started, self.last_reported)
        self.last_reported = now
        if skipped is not None:
            self.log.event("step_skipped", step=done.step, reason=skipped, loss=loss, grad_norm=grad_norm)
        self.state.final_loss = loss
        self.notifier.heartbeat(done.step)
        self.record(done, loss, grad_norm, skipped, counts, seconds)

    def record(
        self,
        done: StepDone,
        loss: float,
        grad_norm: float,
        skipped: str | None,
        counts: StepCounts,
        seconds: float,
    ) -> None:
        """The step's record, expert usage and progress bar, after its update, which took ``seconds``."""
        step, total = done.step, self.total_steps
        ema = self.step_time_ema
        self.step_time_ema = seconds if ema is None else 0.9 * ema + 0.1 * seconds
        tokens_all = counts.input_tokens
        if step % self.cfg.logging.interval == 0 or step == total:
            record = runfolder.TrainRecord(
                step=step,
                total_steps=total,
                epoch=round(done.pos.epoch + done.pos.row / self.train_rows, 4),
                loss=loss,
                lr=done.lr,
                grad_norm=grad_norm,
                tokens=counts.targets,
                tokens_per_sec=round(tokens_all / seconds, 1),
                steps_per_sec=round(1 / seconds, 4),
                eta_seconds=round(self.step_time_ema * (total - step), 1),
                elapsed=round(time.time() - self.train_start, 2),
                peak_mem_mb=self.peak_memory.read_mb(),
                aux_loss=counts.aux_loss,
                skipped=True if skipped else None,
            )
            self.log.append(record)
            self.trackers.log_step(step, loss, done.lr, grad_norm)
        if self.counter.active and (step % self.cfg.logging.expert_interval == 0 or step == total):
            self.flush_experts(step)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_all / seconds:,.0f}")

    def flush_experts(self, step: int) -> None:
        accelerator = self.accelerator
        layers = self.counter.flush(
            all_reduce=lambda t: accelerator.reduce(t.to(accelerator.device), "sum").cpu()
        )
        self.log.append(
            runfolder.ExpertRecord(
                step=step,
                start_step=self.expert_window_start,
                num_experts=self.counter.num_experts,
                top_k=self.counter.top_k,
                layers=layers,
            )
        )
        self.expert_window_start = step + 1

    def close(self) -> None:
        """On every ending: the held step's record first (a step that failed after it leaves it intact)."""
        held = self.held
        try:
            self.flush()
        except Exception as exc:  # a broken device: the run's own error is the one to report
            print(f"WARNING: step {held.step}'s figures could not be read: {exc}", flush=True)
        if self.progress is not None:
            self.progress.close()
