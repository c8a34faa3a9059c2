"""Checkpoint bookkeeping for the loop: what a checkpoint records, resuming from one, retention, best copy.

The file-level work (atomic save, discovery, pruning, the best copy) is ``trainer/training/checkpoint_files.py``;
this module decides what goes in and what happens around a save.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainer import peft_methods, runfolder
from trainer.config import Config
from trainer.data.batches import Position, StepShape
from trainer.training import checkpoint_files as ckpt
from trainer.training import fsdp
from trainer.training.evaluation import best_is, metric_value
from trainer.training.faults import NO_FAULTS, Faults
from trainer.training.optim import repage_state


@dataclass
class LoopState:
    """Where training stands: everything a checkpoint must record to resume exactly."""

    shape: StepShape
    step: int = 0  # optimizer steps completed
    pos: Position = field(default_factory=Position)
    best: float | None = None  # best value of eval.metric_for_best so far
    last_eval: dict | None = None  # the latest evaluation, with its step
    final_loss: float | None = None  # the latest step's loss
    eval_pending: bool = False  # a signal cut this step's evaluation: resume runs it again first

    def trainer_state(self, cfg: Config) -> dict:
        """trainer_state.json; the metric only counts when the evaluation belongs to this step."""
        fresh = self.last_eval if self.last_eval and self.last_eval.get("step") == self.step else None
        return {
            "step": self.step,
            "epoch_index": self.pos.epoch,
            "rows_seen": self.pos.row,
            "metric": cfg.eval.metric_for_best,
            "metric_value": metric_value(fresh, cfg),
            "best_metric": self.best,
            "step_shape": self.shape.as_dict(),  # an OOM fallback's smaller shape survives a resume
            "eval_pending": self.eval_pending,
        }


def find_resume_checkpoint(cfg: Config, resume: str | None, output_dir: Path):
    """--resume_from PATH, --resume (latest, must exist), or automatic when the folder holds one."""
    if resume not in (None, "latest"):
        return ckpt.resolve_resume_path(resume)
    latest = ckpt.latest_checkpoint(output_dir)
    if resume == "latest" and latest is None:
        raise ckpt.CheckpointError(f"--resume: no complete checkpoint in {output_dir}")
    if resume is None and cfg.training.resume == "never":
        return None
    return latest


def model_source(cfg: Config, resume_from) -> Config:
    """A full fine-tune resumes by loading the checkpoint folder itself: save_pretrained may store
    weights in another layout (transformers 5 un-fuses MoE experts on save) that only from_pretrained maps back."""
    if resume_from is None or cfg.training.method != "full":
        return cfg
    model = dataclasses.replace(
        cfg.model, name_or_path=str(resume_from.path), random_init=False, revision=None
    )
    return dataclasses.replace(cfg, model=model)


def load_checkpoint_weights(model, checkpoint: Path, accelerator) -> None:
    """Adapter weights come from the checkpoint's save_pretrained files, not accelerate's state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = checkpoint / "adapter_model.safetensors"
    if adapter.is_file():
        set_peft_model_state_dict(accelerator.unwrap_model(model), load_file(str(adapter)))
        peft_methods.load_into(accelerator.unwrap_model(model), checkpoint)  # LoRA-GA offset, SDLoRA tensors


def skip_model_state(accelerator) -> None:
    """accelerate would save the whole (4-bit) base model in every checkpoint; weights go through
    save_pretrained instead, so its state holds optimizer, scheduler and RNG only."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def restore(resume_from, accelerator, model, state: LoopState, optimizer=None, scheduler=None) -> None:
    """Optimizer, scheduler, RNG and weights from the checkpoint; the loop's position from its state file.

    A saved OOM shape is kept when it still feeds the configured rows per step. Under FSDP the training state
    is sharded (trainer/training/fsdp.py) and the consolidated adapter is copied into the sharded model."""
    check_process_count(resume_from, accelerator)
    state_dir = resume_from.path / ckpt.STATE_DIR
    if fsdp.active(accelerator) and not fsdp.is_sharded_state(state_dir):
        raise ckpt.CheckpointError(
            f"{resume_from.path.name} was saved without FSDP (training.distributed: ddp): its optimizer state is "
            "not sharded; resume it with training.distributed: ddp"
        )
    if fsdp.active(accelerator):
        adapter = resume_from.path / "adapter_model.safetensors"
        fsdp.load_training_state(accelerator, model, optimizer, scheduler, state_dir, not adapter.is_file())
        if adapter.is_file():
            from safetensors.torch import load_file

            fsdp.load_adapter(model, load_file(str(adapter)))
    else:
        if fsdp.is_sharded_state(state_dir):  # written by FSDP, resumed on one process or under DDP
            fsdp.load_sharded_state_unsharded(accelerator, model, optimizer, scheduler, state_dir)
        else:
            accelerator.load_state(str(state_dir))
        load_checkpoint_weights(model, resume_from.path, accelerator)
    if optimizer is not None:
        repage_state(optimizer)
    saved = resume_from.state
    state.step = saved["step"]
    state.pos = Position(saved["epoch_index"], saved["rows_seen"])
    state.best = saved.get("best_metric")
    state.eval_pending = bool(saved.get("eval_pending"))
    shape = saved.get("step_shape")
    if shape and shape["micro"] * shape["accum"] == state.shape.micro * state.shape.accum:
        state.shape = StepShape(**shape)


def check_process_count(resume_from, accelerator) -> None:
    """A checkpoint resumes exactly on the number of processes that wrote it (per-rank RNG states). On
    another count the run goes on with one warning: rows per step follow the new count unless
    gradient_accumulation_steps is changed to match, and the ranks that are gone take their RNG states with
    them. Under FSDP the optimizer shards are resharded as they load (torch.distributed.checkpoint)."""
    saved = resume_from.state.get("processes")
    now = accelerator.num_processes
    if saved is None or saved == now:
        return
    if accelerator.is_main_process:
        sharded = (
            " (FSDP: the optimizer state is resharded onto the new count)" if fsdp.active(accelerator) else ""
        )
        print(
            f"WARNING: {resume_from.path.name} was saved by {saved} processes and resumes on {now}{sharded}: the "
            "run goes on, but random streams differ from an uninterrupted run, and rows per step do too unless "
            "training.gradient_accumulation_steps was scaled to keep micro-batch x accumulation x processes",
            file=sys.stderr,
            flush=True,
        )


@dataclass
class Checkpointer:
    """Saves checkpoint-<step> (final-checkpoint-<step> for kind "final"), logs it, keeps the best copy, prunes."""

    accelerator: object
    model: object
    tokenizer: object
    cfg: Config
    output_dir: Path
    log: runfolder.RunLog
    faults: Faults = NO_FAULTS
    optimizer: object = None  # FSDP writes their sharded state itself (trainer/training/fsdp.py)
    scheduler: object = None

    def save(self, kind: str, state: LoopState) -> None:
        """kind: periodic, signal, oom or final. Updates ``state.best`` when this step's evaluation is better."""
        cfg, log = self.cfg, self.log
        saved = {**state.trainer_state(cfg), "processes": self.accelerator.num_processes}
        is_better = best_is(saved["metric_value"], state.best, cfg)
        if is_better:
            saved["best_metric"] = saved["metric_value"]
        prefix = runfolder.FINAL_PREFIX if kind == "final" else runfolder.CHECKPOINT_PREFIX
        path = ckpt.save_checkpoint(
            self.accelerator,
            self.model,
            self.tokenizer,
            self.output_dir,
            f"{prefix}{state.step}",
            saved,
            self.faults,
            (self.optimizer, self.scheduler),
        )
        state.best = saved["best_metric"]
        if not self.accelerator.is_main_process:
            return
        log.event(
            "checkpoint_saved",
            step=state.step,
            path=str(path),
            size_bytes=ckpt.folder_size(path),
            metric=cfg.eval.metric_for_best,
            metric_value=saved["metric_value"],
            kind=kind,
        )
        if is_better or (kind == "final" and not (self.output_dir / runfolder.BEST_ADAPTER_DIR).exists()):
            target = ckpt.copy_best_adapter(path, self.output_dir)
            log.event(
                "best_updated",
                step=state.step,
                metric=cfg.eval.metric_for_best,
                metric_value=saved["metric_value"],
                path=str(target),
            )
        for removed in ckpt.prune_checkpoints(
            self.output_dir, cfg.training.keep_top_k, cfg.eval.greater_is_better
        ):
            log.event("checkpoint_pruned", step=runfolder.checkpoint_step(removed.name), path=str(removed))
