"""What each optimizer step leaves behind: its training_log.jsonl record, expert usage, the progress bar.

Collectives (token counts, expert counts) run on every rank at the same steps, whatever rank 0 writes.
"""

from __future__ import annotations

import time

import torch

from trainer import runfolder
from trainer.config import Config
from trainer.fastpath.layer_graphs import CudaGraphs
from trainer.training.checkpointing import LoopState
from trainer.training.step import StepResult
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


class StepLog:
    """Writes one step's record every ``logging.interval`` steps and expert usage every ``expert_interval``."""

    def __init__(
        self, cfg: Config, log: runfolder.RunLog, accelerator, counter, trackers: Trackers, total_steps: int,
        train_rows: int, start_step: int,
    ):  # fmt: skip
        self.cfg, self.log, self.accelerator = cfg, log, accelerator
        self.counter, self.trackers = counter, trackers
        self.peak_memory = PeakMemory(accelerator.device)
        self.total_steps, self.train_rows = total_steps, train_rows
        self.progress = make_progress(
            accelerator.is_main_process and cfg.logging.progress_bar, start_step, total_steps
        )
        self.expert_window_start = start_step + 1
        self.train_start = time.time()
        self.step_time_ema: float | None = None

    def record(
        self,
        state: LoopState,
        result: StepResult,
        lr: float,
        grad_norm: float,
        skipped: str | None,
        seconds: float,
    ) -> None:
        """After the update of step ``state.step``, which took ``seconds``; ``state.final_loss`` is its loss."""
        accelerator, step, total, loss = self.accelerator, state.step, self.total_steps, state.final_loss
        ema = self.step_time_ema
        self.step_time_ema = seconds if ema is None else 0.9 * ema + 0.1 * seconds
        tokens_all = result.input_tokens
        if accelerator.num_processes > 1:
            tokens_all = int(accelerator.reduce(torch.tensor(tokens_all, device=accelerator.device), "sum"))
        if step % self.cfg.logging.interval == 0 or step == total:
            aux = float(accelerator.reduce(result.aux_total, "mean")) if result.has_aux else None
            record = runfolder.TrainRecord(
                step=step,
                total_steps=total,
                epoch=round(state.pos.epoch + state.pos.row / self.train_rows, 4),
                loss=loss,
                lr=lr,
                grad_norm=grad_norm,
                tokens=result.target_count,
                tokens_per_sec=round(tokens_all / seconds, 1),
                steps_per_sec=round(1 / seconds, 4),
                eta_seconds=round(self.step_time_ema * (total - step), 1),
                elapsed=round(time.time() - self.train_start, 2),
                peak_mem_mb=self.peak_memory.read_mb(),
                aux_loss=aux,
                skipped=True if skipped else None,
            )
            self.log.append(record)
            self.trackers.log_step(step, loss, lr, grad_norm)
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
        if self.progress is not None:
            self.progress.close()
