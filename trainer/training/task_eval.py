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


def answer_room(task, tokenizer, max_new_tokens: int) -> str | None:
    """Why ``max_new_tokens`` cannot hold one of the task's answer words (a warning), or None when it can.

    An answer is read by whole words: with fewer new tokens than a label word takes (``positive`` is 6
    tokens for a 1024-token vocabulary), no answer can ever name that label, every prediction is
    ``unparsed`` and the metric reads 0 however well the model learned. A word counts at its shortest
    spelling (with or without a leading space)."""
    needs = {}
    for word in task.answer_words():
        needs[word] = min(
            len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (word, " " + word)
        )
    short = {w: n for w, n in needs.items() if n > max_new_tokens}
    if not short:
        return None
    word, n = max(short.items(), key=lambda item: item[1])
    return (
        f"eval.max_new_tokens={max_new_tokens} cannot hold the {task.name} answer '{word}' ({n} tokens with this "
        f"tokenizer): no answer can name it, so {task.metric_for_best.name} will read as if the model never "
        f"answered; set eval.max_new_tokens to at least {max(needs.values()) + 1} (the longest answer word + eos)"
    )


def evaluate_generation(
    model, tokenizer, task, examples: list[dict], cfg: Config, accelerator, stop_check=None
) -> dict:
    """Each rank generates for its share of the examples; predictions are gathered in order, then scored.

    ``stop_check`` (``StopFlag.check``) runs before every generation batch and between scored predictions, as
    often on every rank (a rank with a smaller share makes up its missing batches' checks), and may raise."""
    import sys

    from accelerate.utils import gather_object

    from trainer.training import fsdp
    from trainer.training.generation import batches, generate

    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(examples), world))
    kwargs = generation_kwargs(cfg, task)
    if getattr(accelerator, "is_main_process", True) and not getattr(task, "_answer_room_checked", False):
        task._answer_room_checked = True  # once per task: evaluations repeat through the run
        problem = answer_room(task, tokenizer, kwargs["max_new_tokens"])
        if problem:
            print(f"WARNING: {problem}", file=sys.stderr, flush=True)
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
        unwrapped = accelerator.unwrap_model(model)
        texts = generate(unwrapped, tokenizer, prompts, stop_check=stop_check, **kwargs).texts[: len(mine)]
    if stop_check is not None:  # a rank with fewer batches than the largest share makes up their checks
        rounds = batches(-(-len(examples) // world), kwargs["batch_size"])
        for _ in range(rounds - batches(len(run), kwargs["batch_size"])):
            stop_check()
    pairs = list(zip(mine, texts))
    if world > 1:
        pairs = gather_object(pairs)
    predictions = [text for _, text in sorted(pairs)]
    samples = [
        {"prompt": task.prompt(e), "prediction": p, "target": task.target(e)}
        for p, e in list(zip(predictions, examples))[:3]
    ]
    metrics = task.score(predictions, examples, stop_check=stop_check)
    return {"task": task.name, "metrics": metrics, "samples": samples}
