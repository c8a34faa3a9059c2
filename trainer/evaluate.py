"""Evaluation: token-weighted validation loss, and generation-based task metrics, across all ranks.

Both are sharded over processes and merged before anyone decides what is best, so every rank
agrees on the best checkpoint. Task scoring uses trainer/tasks (official GLUE and Spider metrics).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from trainer.config import Config
from trainer.data import IGNORE, Sequence, collate
from trainer.runfolder import guess_greater_is_better


def count_targets(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


@torch.no_grad()
def evaluate_loss(model, val: list[Sequence], cfg: Config, accelerator, pad_id: int, loss_fn) -> dict:
    """Token-weighted validation loss across all ranks; ``loss_fn`` is the loop's forward_loss."""
    was_training = model.training
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    bs = cfg.eval.batch_size
    batches = [list(range(i, min(i + bs, len(val)))) for i in range(0, len(val), bs)]
    if cfg.eval.max_batches:
        batches = batches[: cfg.eval.max_batches]
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    tokens = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for ids in batches[rank::world]:
        batch = collate([val[i] for i in ids], pad_id)
        ce_sum, _ = loss_fn(model, batch, accelerator)
        loss_sum += ce_sum.double()
        tokens += count_targets(batch)
    loss_sum = accelerator.reduce(loss_sum, "sum")
    tokens = accelerator.reduce(tokens, "sum")
    model.train(was_training)
    eval_loss = float(loss_sum / tokens) if tokens > 0 else float("nan")
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)), "eval_tokens": int(tokens)}


def load_task(cfg: Config):
    """The configured task and its examples (None when eval.task is unset)."""
    if not cfg.eval.task:
        return None, []
    from trainer.tasks import get_task

    task = get_task(cfg.eval.task, cfg.eval.task_data_dir, sql_timeout_s=cfg.eval.sql_timeout_s)
    examples = task.load(cfg.eval.task_split)
    if cfg.eval.task_max_examples:
        examples = examples[: cfg.eval.task_max_examples]
    return task, examples


def resolve_metric(cfg: Config, task) -> Config:
    """``metric_for_best: auto`` means the task's official metric when there is a task, else eval_loss."""
    name, greater = cfg.eval.metric_for_best, cfg.eval.greater_is_better
    if name == "auto":
        name = task.metric_for_best.name if task is not None else "eval_loss"
        if greater is None:
            greater = task.metric_for_best.greater_is_better if task is not None else False
    if greater is None:
        greater = guess_greater_is_better(name)
    return dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, metric_for_best=name, greater_is_better=greater)
    )


def generation_kwargs(cfg: Config, task) -> dict:
    e = cfg.eval
    return {
        "max_new_tokens": e.max_new_tokens or task.max_new_tokens,
        "min_new_tokens": e.min_new_tokens,
        "num_beams": e.num_beams,
        "batch_size": e.generation_batch_size,
        "max_total_length": e.max_total_length,
    }


def evaluate_generation(model, tokenizer, task, examples: list[dict], cfg: Config, accelerator) -> dict:
    """Each rank generates for its share of the examples; predictions are gathered in order, then scored."""
    from accelerate.utils import gather_object

    from trainer.generation import generate

    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(examples), world))
    texts = []
    if mine:
        prompts = [task.prompt(examples[i]) for i in mine]
        texts = generate(
            accelerator.unwrap_model(model), tokenizer, prompts, **generation_kwargs(cfg, task)
        ).texts
    pairs = list(zip(mine, texts))
    if world > 1:
        pairs = gather_object(pairs)
    predictions = [text for _, text in sorted(pairs)]
    samples = [
        {"prompt": task.prompt(e), "prediction": p, "target": task.target(e)}
        for p, e in list(zip(predictions, examples))[:3]
    ]
    return {"task": task.name, "metrics": task.score(predictions, examples), "samples": samples}
