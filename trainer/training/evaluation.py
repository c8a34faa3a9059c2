"""Evaluation during training: validation loss, task metrics, and which evaluation is the best so far.

The validation loss is token-weighted and merged across ranks before anyone decides what is best,
so every rank agrees on the best checkpoint. It uses the run's own micro-batch loss (the step's
kernels), so evaluation and training measure the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from trainer import runfolder
from trainer.config import Config
from trainer.data.dataset import Sequence, collate
from trainer.runfolder import EvalRecord, MetricForBest
from trainer.runfolder import metric_value as runfolder_metric_value
from trainer.training import fsdp
from trainer.training.faults import Faults
from trainer.training.oom_retry import free_memory, is_oom
from trainer.training.step import LossFn, count_targets
from trainer.training.task_eval import evaluate_generation


@torch.no_grad()
def evaluate_loss(
    model, val: list[Sequence], cfg: Config, accelerator, pad_id: int, loss: LossFn, stop_check=None
) -> dict:
    """Token-weighted validation loss across all ranks, with ``loss`` (the run's ``StepKernels.loss``).

    ``stop_check`` (``StopFlag.check``) runs before every batch, the same number of times on every rank,
    so a SIGTERM ends even a long evaluation within one batch, all ranks at the same one."""
    was_training = model.training
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    bs = cfg.eval.batch_size
    batches = [list(range(i, min(i + bs, len(val)))) for i in range(0, len(val), bs)]
    if cfg.eval.max_batches:
        batches = batches[: cfg.eval.max_batches]
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    tokens = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    mine = batches[rank::world]
    rounds = -(-len(batches) // world)  # every rank checks for a stop as often, whatever its share
    # Under FSDP every forward gathers weights from all ranks: each runs as many (a repeat, not counted, if short).
    forward_rounds = rounds if fsdp.active(accelerator) and batches else len(mine)
    try:
        for k in range(rounds):
            if stop_check is not None:
                stop_check()
            if k >= forward_rounds:
                continue
            ids = mine[k] if k < len(mine) else (mine or batches)[-1]
            batch = collate([val[i] for i in ids], pad_id)
            ce_sum, _ = loss(model, batch, accelerator)
            if k < len(mine):
                loss_sum += ce_sum.double()
                tokens += count_targets(batch)
    finally:
        model.train(was_training)
    loss_sum = accelerator.reduce(loss_sum, "sum")
    tokens = accelerator.reduce(tokens, "sum")
    eval_loss = float(loss_sum / tokens) if tokens > 0 else float("nan")
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)), "eval_tokens": int(tokens)}


def metric_for_best(cfg: Config) -> MetricForBest:
    """The resolved ``eval.metric_for_best`` as the run-folder library's rule (readers apply the same)."""
    return MetricForBest(cfg.eval.metric_for_best, cfg.eval.greater_is_better)


def metric_value(eval_result: dict | None, cfg: Config):
    """The value of ``eval.metric_for_best`` in an evaluation, or None when missing or not finite."""
    return runfolder_metric_value(eval_result, cfg.eval.metric_for_best)


def best_is(value, best, cfg: Config) -> bool:
    return metric_for_best(cfg).is_better(value, best)


@dataclass
class Evaluator:
    """Everything an evaluation needs, so the loop calls ``evaluator.run(step, best)``."""

    model: object
    tokenizer: object
    val: list
    task: object
    examples: list
    cfg: Config
    accelerator: object
    pad_id: int
    loss: LossFn
    counter: object  # experts.ExpertCounter: paused, evaluation tokens are not training's routing
    log: runfolder.RunLog
    faults: Faults

    def loss_with_oom_fallback(self, step: int, stop_check=None) -> dict | None:
        """An OOM while evaluating halves the evaluation batch; at batch 1 the evaluation is skipped, never fatal."""
        while True:
            try:
                self.faults.oom("eval", step)
                return evaluate_loss(
                    self.model, self.val, self.cfg, self.accelerator, self.pad_id, self.loss, stop_check
                )
            except Exception as exc:
                if not is_oom(exc) or self.accelerator.num_processes > 1:
                    raise
                free_memory()
                old = self.cfg.eval.batch_size
                if old == 1:
                    self.log.event("eval_skipped", step=step, reason="out_of_memory")
                    return None
                new_eval = dataclasses.replace(self.cfg.eval, batch_size=old // 2)
                self.cfg = dataclasses.replace(self.cfg, eval=new_eval)
                self.log.event(
                    "oom_fallback",
                    step=step,
                    phase="eval",
                    old={"eval_batch_size": old},
                    new={"eval_batch_size": old // 2},
                )

    def run(self, step: int, best, stop_check=None) -> dict | None:
        """Evaluate now; logs eval_log.jsonl and the events, returns the result with its step (None if none ran).

        ``stop_check`` runs between batches (loss, generation, scoring) and raises to abandon the evaluation:
        then no record is written, and the caller decides what a cut evaluation means."""
        if not self.val and self.task is None:
            return None
        self.counter.stop()
        self.log.event("eval_start", step=step)
        try:
            result = self.evaluate(step, stop_check)
        finally:
            if fsdp.active(self.accelerator):
                fsdp.reshard(self.model)  # no backward followed these forwards to free the gathered layers
        if result is None:
            return None
        value = metric_value(result, self.cfg)
        is_best = best_is(value, best, self.cfg)
        self.log.append(EvalRecord.from_result(step, result, metric_for_best(self.cfg), is_best))
        self.log.event("eval_done", step=step, eval_loss=result.get("eval_loss"), metric_value=value)
        return {**result, "step": step}

    def evaluate(self, step: int, stop_check) -> dict | None:
        """The validation loss, then the task's metrics; None when the loss could not be measured."""
        result = {}
        if self.val:
            result = self.loss_with_oom_fallback(step, stop_check)
            if result is None:
                return None
        if self.task is not None:
            generated = evaluate_generation(
                self.model, self.tokenizer, self.task, self.examples, self.cfg, self.accelerator, stop_check
            )
            result.update(task=generated["task"], metrics=generated["metrics"], samples=generated["samples"])
        return result
