"""``evaluate``: score a checkpoint on the validation split and/or a task, standalone.

The config defaults to the one saved in the checkpoint's run folder, so the base model is rebuilt
exactly as training built it; ``--task`` and friends override the eval section.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.commands import load_config_from_args
from trainer.runfolder.layout import CONFIG_YAML, TRAINER_STATE


def register(subparsers) -> None:
    parser = subparsers.add_parser("evaluate", help="evaluate a checkpoint (validation loss and/or a task)")
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint-<step>, final-checkpoint-<step> or best-adapter"
    )
    parser.add_argument(
        "--config", default=None, help="YAML config (default: <run>/config.yaml beside the checkpoint)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--task", help="glue task name (sst2, cola, ...) or spider")
    parser.add_argument("--task-data-dir", help="GLUE download folder or Spider folder")
    parser.add_argument("--split", help="task split (default: validation)")
    parser.add_argument("--max-examples", type=int, help="evaluate on the first N task examples")
    parser.add_argument(
        "--sql-timeout-s", type=float, help="seconds one SQL query may run (spider; eval.sql_timeout_s)"
    )
    parser.add_argument("--no-loss", action="store_true", help="skip the validation loss")
    parser.set_defaults(func=run)


def run(args) -> int:
    from trainer.cli import EXIT_BAD_INPUT

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        print(f"error: --checkpoint: folder not found: {checkpoint}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.config is None:
        args.config = str(checkpoint.parent / CONFIG_YAML)
    for flag, key in (
        ("task", "task"),
        ("task_data_dir", "task_data_dir"),
        ("split", "task_split"),
        ("max_examples", "task_max_examples"),
        ("sql_timeout_s", "sql_timeout_s"),
    ):
        value = getattr(args, flag)
        if value is not None:
            args.overrides.append(f"eval.{key}={value}")
    cfg = load_config_from_args(args)
    results = evaluate_checkpoint(cfg, checkpoint, with_loss=not args.no_loss)
    text = json.dumps(_finite(results), indent=2, allow_nan=False)
    target = free_results_path(checkpoint)
    target.write_text(text + "\n")
    print(text)
    print(f"written to {target}", file=sys.stderr)
    return 0


def free_results_path(checkpoint: Path) -> Path:
    """eval_results.json, or eval_results-2.json, -3, ...: an earlier evaluation is never overwritten."""
    target, n = checkpoint / "eval_results.json", 1
    while target.exists():
        n += 1
        target = checkpoint / f"eval_results-{n}.json"
    return target


def _finite(results: dict) -> dict:
    """NaN/inf (an undefined loss) as null, named in ``nonfinite``, as the run folder's logs write them."""
    from trainer.runfolder import clean_value

    nonfinite: list[str] = []
    cleaned = clean_value(results, "", nonfinite)
    return {**cleaned, "nonfinite": nonfinite} if nonfinite else cleaned


def evaluate_checkpoint(cfg, checkpoint: Path, with_loss: bool = True) -> dict:
    from accelerate import Accelerator

    from trainer.data.dataset import prepare_data
    from trainer.data.prepare import workers_of
    from trainer.model.loading import load_for_training
    from trainer.runfolder.checkpoints import CheckpointInfo, read_state
    from trainer.training.checkpointing import load_checkpoint_weights, model_source
    from trainer.training.evaluation import evaluate_loss
    from trainer.training.step import choose_kernels
    from trainer.training.task_eval import evaluate_generation, load_task

    accelerator = Accelerator(mixed_precision=cfg.training.mixed_precision)
    state = read_state(checkpoint) if (checkpoint / TRAINER_STATE).is_file() else {"step": None}
    info = CheckpointInfo(checkpoint, state.get("step") or 0, state)
    loaded = load_for_training(model_source(cfg, info), accelerator.device)
    kernels = choose_kernels(loaded, cfg, accelerator.device)
    model = accelerator.prepare(kernels.prepare(loaded.model))
    load_checkpoint_weights(model, checkpoint, accelerator)
    results: dict = {"checkpoint": str(checkpoint), "step": state.get("step")}
    pad_id = loaded.tokenizer.pad_token_id or 0
    if with_loss:
        data = prepare_data(
            cfg.paths, cfg.data, loaded.tokenizer, loaded.family.packing, workers_of(cfg.performance)
        )
        if data.val:
            results.update(evaluate_loss(model, data.val, cfg, accelerator, pad_id, kernels.loss))
    task, examples = load_task(cfg)
    if task is not None:
        generated = evaluate_generation(model, loaded.tokenizer, task, examples, cfg, accelerator)
        results.update(
            task=generated["task"],
            metrics=generated["metrics"],
            samples=generated["samples"],
            examples=len(examples),
        )
    return results
