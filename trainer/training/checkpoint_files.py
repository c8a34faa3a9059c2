"""Checkpoints: atomic save, discovery of the latest complete one, top-K retention, best and final copies.

A checkpoint is written under ``.tmp-checkpoint-<step>`` and renamed once whole, so a folder
named ``checkpoint-<step>`` is always complete: a crash mid-save leaves only a temporary folder,
which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.runfolder import (
    BEST_ADAPTER_DIR,
    CHECKPOINT_PREFIX,
    FINAL_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    TRAINING_STATE_DIR,
    checkpoint_step,
    folder_size,  # noqa: F401 - the loop sizes checkpoints through ckpt.folder_size
    read_run_json,
)
from trainer.training.faults import NO_FAULTS, Faults

STATE_DIR = TRAINING_STATE_DIR
MODEL_FILES = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json")


class CheckpointError(RuntimeError):
    """A checkpoint path given by the user is not a usable checkpoint."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    state: dict

    @property
    def metric_value(self):
        return self.state.get("metric_value")


def is_complete(path: Path) -> bool:
    """Complete = renamed into place, with its state file and weights."""
    if (
        path.name.startswith(TMP_PREFIX)
        or not (path / TRAINER_STATE).is_file()
        or not (path / STATE_DIR).is_dir()
    ):
        return False
    return any((path / name).is_file() for name in MODEL_FILES)


def read_state(path: Path) -> dict:
    return json.loads((path / TRAINER_STATE).read_text())


def list_checkpoints(output_dir: Path, include_final: bool = True) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest step first."""
    found = []
    if not output_dir.is_dir():
        return found
    for child in output_dir.iterdir():
        step = checkpoint_step(child.name)
        if step is None or not child.is_dir() or (child.name.startswith(FINAL_PREFIX) and not include_final):
            continue
        if is_complete(child):
            found.append(CheckpointInfo(child, step, read_state(child)))
    return sorted(found, key=lambda c: (c.step, c.path.name.startswith(FINAL_PREFIX)))


def latest_checkpoint(output_dir: Path) -> CheckpointInfo | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


@dataclass
class FinishedRun:
    step: int
    checkpoint: Path | None  # its final checkpoint, when still on disk


def finished_run(output_dir: Path) -> FinishedRun | None:
    """The run in ``output_dir`` if it finished: its latest checkpoint is a final one, or run.json says so.

    Resuming such a run would re-save its final checkpoint and log a second run_end, so the train
    command asks first (trainer/commands/train.py). A run extended past its final checkpoint has a
    later periodic checkpoint and counts as unfinished until its new final one.
    """
    latest = latest_checkpoint(output_dir)
    if latest is not None and latest.path.name.startswith(FINAL_PREFIX):
        return FinishedRun(latest.step, latest.path)
    info = read_run_json(output_dir)
    if info.get("status") == "finished" and isinstance(info.get("step"), int):
        if latest is None or latest.step <= info["step"]:
            return FinishedRun(info["step"], None)
    return None


def resolve_resume_path(path: str | Path) -> CheckpointInfo:
    """``--resume_from PATH``: a checkpoint folder, or a run folder whose latest checkpoint is taken."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--resume_from: path not found: {path}")
    if checkpoint_step(path.name) is not None:
        if not is_complete(path):
            raise CheckpointError(
                f"--resume_from: {path} is not a complete checkpoint (missing {TRAINER_STATE} or weights)"
            )
        return CheckpointInfo(path, checkpoint_step(path.name), read_state(path))
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"--resume_from: no complete checkpoint-<step> folder in {path}")
    return latest


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
