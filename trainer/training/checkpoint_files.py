"""Checkpoints: atomic save, top-K retention, best and final copies; finding them is the run-folder library's
(trainer/runfolder/checkpoints.py), whose names are handed on from here.

A checkpoint is written under ``.tmp-checkpoint-<step>`` and renamed once whole, so a folder
named ``checkpoint-<step>`` is always complete: a crash mid-save leaves only a temporary folder,
which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from trainer.runfolder import (
    BEST_ADAPTER_DIR,
    CHECKPOINT_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    folder_size,  # noqa: F401 - the loop sizes checkpoints through ckpt.folder_size
)
from trainer.runfolder.checkpoints import (  # noqa: F401 - the loop and commands find checkpoints through here
    MODEL_FILES,
    STATE_DIR,
    CheckpointError,
    CheckpointInfo,
    FinishedRun,
    finished_run,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    resolve_resume_path,
)
from trainer.training.faults import NO_FAULTS, Faults


def remove_stale_temporaries(output_dir: Path) -> None:
    for child in output_dir.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(child, ignore_errors=True)


def fsync_tree(path: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(
    accelerator,
    model,
    tokenizer,
    output_dir: Path,
    name: str,
    state: dict,
    faults: Faults = NO_FAULTS,
    optimizer_and_scheduler: tuple = (None, None),
) -> Path:
    """Write the weights (adapter or full model), tokenizer, accelerate state and trainer_state.json.

    Every process takes part (accelerate writes per-process RNG states; FSDP gathers the weights from
    every rank and writes its state shards); rank 0 renames.
    """
    from trainer.training import fsdp  # here: discovery and pruning stay free of torch

    final = output_dir / name
    tmp = output_dir / f"{TMP_PREFIX}{name}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    is_peft = hasattr(unwrapped, "peft_config")
    weights = None  # None: save_pretrained reads the model's own (whole) weights
    if fsdp.active(accelerator):
        optimizer, scheduler = optimizer_and_scheduler
        fsdp.save_training_state(accelerator, model, optimizer, scheduler, tmp / STATE_DIR, not is_peft)
        is_main = accelerator.is_main_process
        weights = fsdp.gather_trainable(model, is_main) if is_peft else fsdp.gather_full_model(model)
    else:
        accelerator.save_state(str(tmp / STATE_DIR))
    if accelerator.is_main_process:
        if is_peft:
            from trainer import peft_methods

            # The base embeddings/head are unchanged (no vocabulary resize): the adapter alone is enough.
            unwrapped.save_pretrained(
                tmp, safe_serialization=True, save_embedding_layers=False, state_dict=weights
            )
            peft_methods.save_into(
                unwrapped, tmp
            )  # LoRA-GA's init, SDLoRA's SSM tensors (if the method has them)
        else:
            unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        faults.during_save(name)  # tests: die like SIGKILL half-way through a save
        (tmp / TRAINER_STATE).write_text(json.dumps({**state, "ts": round(time.time(), 3)}, indent=2) + "\n")
        fsync_tree(tmp)
        if final.exists():
            # Re-saving a step after a resume: move the old copy aside first so a crash never leaves neither.
            old = output_dir / f"{TMP_PREFIX}old-{name}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(output_dir: Path, keep_top_k: int, greater_is_better: bool) -> list[Path]:
    """Keep the top-K periodic checkpoints by metric, plus the latest; return what was removed."""
    periodic = [
        c
        for c in list_checkpoints(output_dir, include_final=False)
        if c.path.name.startswith(CHECKPOINT_PREFIX)
    ]
    if len(periodic) <= keep_top_k:
        return []
    latest = periodic[-1]
    with_metric = [c for c in periodic if c.metric_value is not None]
    sign = -1 if greater_is_better else 1
    ranked = sorted(with_metric, key=lambda c: (sign * c.metric_value, -c.step))
    keep = {c.path for c in ranked[:keep_top_k]} | {latest.path}
    if not with_metric:  # no evaluations yet: keep the newest K
        keep = {c.path for c in periodic[-keep_top_k:]}
    removed = []
    for checkpoint in periodic:
        if checkpoint.path not in keep:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
            removed.append(checkpoint.path)
    return removed


def copy_best_adapter(checkpoint: Path, output_dir: Path) -> Path:
    """The best checkpoint's weights and tokenizer (no optimizer state), replaced atomically."""
    target = output_dir / BEST_ADAPTER_DIR
    tmp = output_dir / f"{TMP_PREFIX}{BEST_ADAPTER_DIR}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns(STATE_DIR))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target
