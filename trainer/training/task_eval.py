"""Task evaluation: generation-based task metrics across all ranks, the task and the metric for "best".

Generation is sharded over processes and gathered before scoring, so every rank agrees on the best
checkpoint. Task scoring uses trainer/tasks (official GLUE and Spider metrics); generating is
``generation``. The validation loss is ``evaluation``, since it uses the step's loss.
"""

from __future__ import annotations

import dataclasses

from trainer.config import Config
from trainer.runfolder import guess_greater_is_better


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

    from trainer.training import fsdp
    from trainer.training.generation import generate

    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(examples), world))
    kwargs = generation_kwargs(cfg, task)
    run = mine
    if fsdp.active(accelerator) and examples:
        # Every forward gathers weights from all ranks: each rank runs as many batches (padded with repeats,
        # whose text is dropped) and keeps stepping until all ranks are done (synced_gpus).
        share = -(-len(examples) // world)
        run = (mine or [0]) + [(mine or [0])[-1]] * (share - len(mine or [0]))
        kwargs["synced_gpus"] = True
    texts = []
    if run:
        prompts = [task.prompt(examples[i]) for i in run]
        texts = generate(accelerator.unwrap_model(model), tokenizer, prompts, **kwargs).texts[: len(mine)]
    pairs = list(zip(mine, texts))
    if world > 1:
        pairs = gather_object(pairs)
    predictions = [text for _, text in sorted(pairs)]
    samples = [
        {"prompt": task.prompt(e), "prediction": p, "target": task.target(e)}
        for p, e in list(zip(predictions, examples))[:3]
    ]
    return {"task": task.name, "metrics": task.score(predictions, examples), "samples": samples}
