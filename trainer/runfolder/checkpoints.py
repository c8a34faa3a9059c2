"""Finding a run folder's checkpoints: which are complete, the latest, whether the run finished, and what
``--resume_from`` names. Read by the trainer (resume), ``list``, reports and the exit report alike, so it
lives with the run-folder library; writing checkpoints is the trainer's (trainer/training/checkpoint_files.py).

A checkpoint is written under ``.tmp-checkpoint-<step>`` and renamed once whole, so a folder named
``checkpoint-<step>`` with its state file and weights is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainer.runfolder.layout import (
    FINAL_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    TRAINING_STATE_DIR,
    checkpoint_step,
)
from trainer.runfolder.reader import read_run_json

STATE_DIR = TRAINING_STATE_DIR
# A checkpoint holds one of these weights files (an adapter, or a full model whole or sharded).
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
