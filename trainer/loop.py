"""The training loop: setup helpers first, then ``train()``, readable top to bottom.

forward -> backward (accumulate) -> clip -> step -> schedule -> log -> evaluate -> checkpoint.
The loss is normalised by the target tokens of the whole accumulated batch across micro-batches
and ranks, so micro-batch 4 x accumulation 4 gives the gradients of one batch of 16.
Rank 0 writes the run folder; every rank trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer import checkpoints as ckpt
from trainer import chunked_loss, fastpath, runlog
from trainer.config import Config, dump_config
from trainer.data import IGNORE, Sequence, collate, epoch_order, prepare_data
from trainer.evaluate import count_targets, evaluate_generation, evaluate_loss, load_task, resolve_metric
from trainer.experts import ExpertCounter
from trainer.modeling import load_for_training
from trainer.notify import Notifier
from trainer.oom import (
    OomInjector,
    OutOfMemoryAfterRetries,
    StepShape,
    free_memory,
    is_oom,
    shrink,
    split_rows,
)
from trainer.runfolder import EvalRecord, MetricForBest
from trainer.runfolder import metric_value as runfolder_metric_value
from trainer.telemetry import TelemetrySampler

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


# ---------------------------------------------------------------- setup helpers


def make_accelerator(cfg: Config):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    kwargs = {}
    if cfg.logging.report_to:
        kwargs.update(
            log_with=cfg.logging.report_to, project_dir=str(Path(cfg.paths.output_dir) / "trackers")
        )
    return Accelerator(
        mixed_precision=cfg.training.mixed_precision,
        dataloader_config=DataLoaderConfiguration(non_blocking=cfg.performance.pin_memory),
        **kwargs,
    )


def make_optimizer(model, cfg: Config, on_cuda: bool):
    """AdamW, or bitsandbytes' 8-bit / paged variants (CUDA only: they page through unified memory)."""
    o = cfg.optimization
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": o.learning_rate, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_epsilon}
    if o.optimizer == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    if not on_cuda:
        raise RuntimeError(f"optimization.optimizer: {o.optimizer} needs a CUDA GPU; use adamw on CPU")
    import bitsandbytes as bnb

    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[o.optimizer]
    return cls(groups, **kwargs)


def warmup_steps(cfg: Config, total_steps: int) -> int:
    o = cfg.optimization
    return o.warmup_steps if o.warmup_steps > 0 else int(math.ceil(o.warmup_ratio * total_steps))


def make_scheduler(optimizer, cfg: Config, total_steps: int):
    from transformers import get_scheduler

    o = cfg.optimization
    name, extra = o.lr_scheduler, {}
    warmup = warmup_steps(cfg, total_steps)
    if name == "constant":
        name = "constant_with_warmup"
    elif name == "cosine" and o.min_lr_ratio > 0:
        name, extra = "cosine_with_min_lr", {"min_lr_rate": o.min_lr_ratio}
    elif name == "polynomial":
        extra = {"power": o.polynomial_power, "lr_end": o.learning_rate * o.min_lr_ratio}
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra or None,
    )


@dataclass
class Position:
    """Where the loop is in the data: epoch and rows consumed within it (global, all ranks)."""

    epoch: int = 0
    row: int = 0


def next_step_rows(
    train_rows: int, rows_per_step: int, seed: int, pos: Position
) -> tuple[list[int], Position]:
    """Row ids for the next optimizer step; a partial remainder at an epoch's end is dropped."""
    if pos.row + rows_per_step > train_rows:
        pos = Position(pos.epoch + 1, 0)
    order = epoch_order(train_rows, seed, pos.epoch)
    return order[pos.row : pos.row + rows_per_step], Position(pos.epoch, pos.row + rows_per_step)


def micro_batches(
    rows: list[int], data: list[Sequence], shape: StepShape, world: int, rank: int, pad_id: int
):
    """This rank's micro-batches of one optimizer step: micro-batch k of rank r takes the k*world+r-th slice.

    After an OOM at micro-batch 1, rows are split into shorter pieces, fed one piece per micro-batch."""
    slices = [rows[i : i + shape.micro] for i in range(0, len(rows), shape.micro)]
    mine = [[data[j] for j in s] for s in slices[rank::world]]
    if shape.split_length is not None:
        mine = [[piece] for group in mine for piece in split_rows(group, shape.split_length)]
    return [collate(group, pad_id) for group in mine]


def accumulate_gradients(model, batches: list[dict], accelerator, counter: ExpertCounter, aux_coef: float):
    """Forward and backward over one optimizer step's micro-batches, loss normalised by all its target tokens."""
    world = accelerator.num_processes
    local_targets = torch.tensor(float(sum(count_targets(b) for b in batches)), device=accelerator.device)
    global_targets = accelerator.reduce(local_targets, "sum").clamp(min=1.0)
    ce_total = torch.zeros((), device=accelerator.device)
    aux_total = torch.zeros((), device=accelerator.device)
    input_tokens = sum(int(b["token_mask"].sum()) for b in batches)
    aux = None
    for k, batch in enumerate(batches):
        sync = k == len(batches) - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            counter.start_micro_batch(batch["token_mask"])
            ce_sum, aux = forward_loss(model, batch, accelerator)
            # DDP averages gradients over ranks, hence x world; dividing by all target tokens
            # of the step makes every token count the same whatever micro-batch it sits in.
            loss = ce_sum * world / global_targets
            if aux is not None and aux_coef:
                loss = loss + aux_coef * aux / len(batches)
                aux_total += aux.detach() / len(batches)
            accelerator.backward(loss)
        ce_total += ce_sum.detach()
    return global_targets, ce_total, aux_total, input_tokens, aux


def oom_failure(step: int, shape: StepShape, cfg: Config, world: int) -> OutOfMemoryAfterRetries:
    """The error for an OOM the fallback cannot absorb: out of retries, of room to shrink, or multi-process."""
    return OutOfMemoryAfterRetries(
        f"out of memory at step {step + 1} with micro_batch_size={shape.micro}, "
        f"gradient_accumulation_steps={shape.accum}, split length {shape.split_length or cfg.data.max_length}"
        f"{'' if world == 1 else ' (the fallback runs in single-process training only)'}; "
        f"checkpoint-{step} holds the last completed step. Lower training.micro_batch_size or data.max_length, "
        "or enable memory.gradient_checkpointing"
    )


def forward_loss(model, batch: dict, accelerator):
    """Summed next-token cross-entropy of one micro-batch, and the router aux loss if the model has one."""
    from trainer.families import family_inputs

    inputs = {k: v.to(accelerator.device) for k, v in family_inputs(model, batch).items()}
    if fastpath.enabled(model):  # CUDA fast path: fused linear cross-entropy (trainer/fastpath)
        return fastpath.forward_loss(model, inputs, batch["labels"], accelerator.autocast)
    if chunked_loss.enabled(model):  # memory.chunked_loss: no full fp32 logits (trainer/chunked_loss.py)
        head = chunked_loss.output_head(model)
        with accelerator.autocast():
            with chunked_loss.head_bypassed(head):
                out = model(**inputs, use_cache=False)
            hidden = out.logits.reshape(*batch["labels"].shape, -1)
            ce_sum = chunked_loss.chunked_cross_entropy(head, hidden, batch["labels"])
        return ce_sum, getattr(out, "aux_loss", None)
    with accelerator.autocast():
        out = model(**inputs, use_cache=False)
    # A family may flatten packed rows into one (GLA's varlen cu_seqlens): back to the batch's shape.
    logits = out.logits.reshape(*batch["labels"].shape, -1)[:, :-1].float()
    labels = batch["labels"][:, 1:].to(logits.device)
    ce_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return ce_sum, getattr(out, "aux_loss", None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return round(peak, 1)
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def library_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "flash-linear-attention"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


class StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current step."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.signum = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


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


def skip_model_state(accelerator) -> None:
    """accelerate would save the whole (4-bit) base model in every checkpoint; weights go through
    save_pretrained instead, so its state holds optimizer, scheduler and RNG only."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


# ---------------------------------------------------------------- the loop


def train(cfg: Config, resume: str | None = None, config_source: str | None = None) -> int:
    """Run training; returns the process exit code (0 done, 130/143 stopped by a signal)."""
    accelerator = make_accelerator(cfg)
    is_main = accelerator.is_main_process
    output_dir = Path(cfg.paths.output_dir).resolve()
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_stale_temporaries(output_dir)
    accelerator.wait_for_everyone()
    if cfg.performance.torch_threads:
        torch.set_num_threads(cfg.performance.torch_threads)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.performance.tf32
        torch.backends.cudnn.allow_tf32 = cfg.performance.tf32

    resume_from = find_resume_checkpoint(cfg, resume, output_dir)
    log = runlog.RunLog(output_dir, enabled=is_main)
    step = 0
    try:
        from accelerate.utils import set_seed

        set_seed(cfg.training.seed)
        loaded = load_for_training(model_source(cfg, resume_from), accelerator.device)
        model, tokenizer = loaded.model, loaded.tokenizer
        data = prepare_data(
            cfg.paths, cfg.data, tokenizer, loaded.family.packing, cfg.performance.dataloader_num_workers
        )
        task, task_examples = load_task(cfg)
        cfg = resolve_metric(cfg, task)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        world = accelerator.num_processes
        micro, accum = cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps
        rows_per_step = micro * accum * world
        shape = StepShape(micro, accum)
        steps_per_epoch = len(data.train) // rows_per_step
        if steps_per_epoch == 0:
            raise ValueError(
                f"paths.train_file: {len(data.train)} training rows, fewer than one optimizer step needs "
                f"({micro} x {accum} accumulation x {world} processes)"
            )
        total_steps = cfg.training.max_steps or math.ceil(cfg.training.num_epochs * steps_per_epoch)

        optimizer = make_optimizer(model, cfg, accelerator.device.type == "cuda")
        scheduler = make_scheduler(optimizer, cfg, total_steps)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(scheduler)
        skip_model_state(accelerator)
        counter = ExpertCounter(accelerator.unwrap_model(model))
        injector = OomInjector()
        evaluator = Evaluator(
            model, tokenizer, data.val, task, task_examples, cfg, accelerator, pad_id, counter, log, injector
        )

        pos, best, run_info = Position(), None, runlog.read_run_json(output_dir)
        if resume_from is not None:
            accelerator.load_state(str(resume_from.path / ckpt.STATE_DIR))
            load_checkpoint_weights(model, resume_from.path, accelerator)
            step = resume_from.state["step"]
            pos = Position(resume_from.state["epoch_index"], resume_from.state["rows_seen"])
            best = resume_from.state.get("best_metric")
            saved_shape = resume_from.state.get("step_shape")
            if saved_shape and saved_shape["micro"] * saved_shape["accum"] == micro * accum:
                shape = StepShape(**saved_shape)
        if is_main:
            dump_config(cfg, output_dir / runlog.CONFIG_YAML)
        run_info = log.update_run(
            run_id=run_info.get("run_id") or f"{output_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            started_at=run_info.get("started_at") or round(time.time(), 3),
            ended_at=None,
            status="running",
            model=cfg.model.name_or_path,
            family=loaded.family.name,
            model_type=loaded.model_type,
            method=cfg.training.method,
            world_size=world,
            hosts=sorted({socket.gethostname()}),
            pid=os.getpid(),
            total_steps=total_steps,
            step=step,
            versions=library_versions(),
            output_dir=str(output_dir),
            config_source=config_source,
            resumes=run_info.get("resumes", 0) + (1 if resume_from else 0),
        )
        log.event(
            "run_start", step=step, resumed=resume_from is not None, world_size=world, total_steps=total_steps
        )
        if resume_from is not None:
            log.event("resume", step=step, from_checkpoint=str(resume_from.path))
        log.event("data_report", step=step, **data.report.as_event())
        log.event("model_report", step=step, **loaded.report)
        announce(accelerator, cfg, loaded, data, total_steps, resume_from)
        if is_main:
            length_report(cfg, tokenizer, output_dir, log, step)
        notifier = Notifier.from_config(cfg, run_name=output_dir.name, enabled=is_main)
        notifier.notify(
            "start",
            {
                "step": step,
                "total_steps": total_steps,
                "model": cfg.model.name_or_path,
                "resumed": resume_from is not None,
                "output_dir": str(output_dir),
            },
        )
        if cfg.logging.report_to:
            accelerator.init_trackers(output_dir.name, config=flat_config(cfg))
    except BaseException as exc:
        record_failure(log, exc, step, accelerator)
        raise

    telemetry = TelemetrySampler(
        output_dir, cfg.logging.telemetry_interval, enabled=accelerator.is_local_main_process
    )
    telemetry.start()
    stop = StopFlag()
    stop.install()

    def save_now(kind: str):
        """Checkpoint the current state (the loop's variables as they are now); returns the best metric."""
        return save_and_retain(
            accelerator, model, tokenizer, cfg, output_dir, log, step, pos, last_eval, best, kind, shape
        )

    progress = make_progress(is_main and cfg.logging.progress_bar, step, total_steps)
    aux_coef = float(getattr(accelerator.unwrap_model(model).config, "router_aux_loss_coef", 0.0) or 0.0)
    last_eval: dict | None = None
    expert_window_start = step + 1
    train_start = time.time()
    step_time_ema: float | None = None
    final_loss = None
    exit_code = 0
    try:
        model.train()
        if cfg.eval.at_start and step == 0:
            last_eval = evaluator.run(step, best)
        while step < total_steps:
            t0 = time.time()
            rows, pos = next_step_rows(len(data.train), rows_per_step, cfg.training.seed, pos)
            for attempt in range(cfg.memory.max_oom_retries + 1):
                try:
                    injector.check("train", step + 1)
                    batches = micro_batches(rows, data.train, shape, world, accelerator.process_index, pad_id)
                    acc = accumulate_gradients(model, batches, accelerator, counter, aux_coef)
                    break
                except Exception as exc:
                    optimizer.zero_grad(set_to_none=True)
                    if not is_oom(exc):
                        raise
                    batches = None
                    free_memory()
                    smaller = shrink(shape, cfg.data.max_length)
                    if (
                        not cfg.memory.oom_fallback
                        or world > 1
                        or smaller is None
                        or attempt == cfg.memory.max_oom_retries
                    ):
                        if step > 0 and world == 1:
                            save_now("oom")  # keep what was trained before failing
                        raise oom_failure(step, shape, cfg, world) from exc
                    log.event(
                        "oom_fallback",
                        step=step + 1,
                        old=shape.as_dict(),
                        new=smaller.as_dict(),
                        attempt=attempt + 1,
                    )
                    if is_main:
                        print(
                            f"out of memory at step {step + 1}: now {smaller.as_dict()} (same rows per step)",
                            flush=True,
                        )
                    shape = smaller
            global_targets, ce_total, aux_total, input_tokens, aux = acc
            step += 1
            step_loss = float(accelerator.reduce(ce_total, "sum") / global_targets)
            max_norm = cfg.optimization.max_grad_norm or float("inf")
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
            lr = scheduler.get_last_lr()[0]
            skipped = None
            if not math.isfinite(step_loss):
                skipped = "nonfinite_loss"
            elif not math.isfinite(grad_norm) and cfg.training.mixed_precision != "fp16":
                skipped = "nonfinite_grad_norm"  # fp16: the grad scaler skips and lowers its scale itself
            if skipped is None:
                optimizer.step()
            else:
                log.event("step_skipped", step=step, reason=skipped, loss=step_loss, grad_norm=grad_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            final_loss = step_loss
            notifier.heartbeat(step)

            elapsed_step = time.time() - t0
            step_time_ema = (
                elapsed_step if step_time_ema is None else 0.9 * step_time_ema + 0.1 * elapsed_step
            )
            tokens_all = int(accelerator.reduce(torch.tensor(input_tokens, device=accelerator.device), "sum"))
            if step % cfg.logging.interval == 0 or step == total_steps:
                record = {
                    "step": step,
                    "total_steps": total_steps,
                    "epoch": round(pos.epoch + pos.row / len(data.train), 4),
                    "loss": step_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": int(global_targets),
                    "tokens_per_sec": round(tokens_all / elapsed_step, 1),
                    "steps_per_sec": round(1 / elapsed_step, 4),
                    "eta_seconds": round(step_time_ema * (total_steps - step), 1),
                    "elapsed": round(time.time() - train_start, 2),
                    "peak_mem_mb": peak_memory_mb(accelerator.device),
                }
                if aux is not None:
                    record["aux_loss"] = float(accelerator.reduce(aux_total, "mean"))
                if skipped:
                    record["skipped"] = True
                log.write(runlog.TRAINING_LOG, record)
                if cfg.logging.report_to:
                    accelerator.log(
                        {"train/loss": step_loss, "train/lr": lr, "train/grad_norm": grad_norm}, step=step
                    )
            if counter.active and (step % cfg.logging.expert_interval == 0 or step == total_steps):
                layers = counter.flush(
                    all_reduce=lambda t: accelerator.reduce(t.to(accelerator.device), "sum").cpu()
                )
                log.write(
                    runlog.EXPERT_LOG,
                    {
                        "step": step,
                        "start_step": expert_window_start,
                        "num_experts": counter.num_experts,
                        "top_k": counter.top_k,
                        "layers": layers,
                    },
                )
                expert_window_start = step + 1
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens_all / elapsed_step:,.0f}")

            should_save = step % cfg.training.save_steps == 0 and step < total_steps
            if step % cfg.eval.interval == 0 or should_save or (step == total_steps and cfg.eval.at_end):
                last_eval = evaluator.run(step, best)
                if cfg.logging.report_to and last_eval:
                    accelerator.log(tracker_eval_metrics(last_eval), step=step)
            if should_save:
                best = save_now("periodic")
            if stop_requested(stop, accelerator):
                signame = signal.Signals(stop.signum).name if stop.signum else "SIGTERM"
                log.event("signal", step=step, signal=signame)
                if not should_save:
                    best = save_now("signal")
                exit_code = EXIT_SIGNAL.get(stop.signum, 143)
                break
            if step % 10 == 0:
                log.update_run(step=step)
        else:
            best = save_now("final")
    except BaseException as exc:
        if progress is not None:
            progress.close()
        telemetry.stop()
        stop.restore()
        record_failure(log, exc, step, accelerator)
        if cfg.logging.report_to:
            accelerator.end_training()  # closes W&B / MLflow runs as failed rather than leaving them open
        notifier.notify("failure", {"step": step, "error": f"{type(exc).__name__}: {exc}"})
        notifier.close()
        raise
    if progress is not None:
        progress.close()
    telemetry.stop()
    stop.restore()
    status = "finished" if exit_code == 0 else "interrupted"
    log.update_run(status=status, step=step, ended_at=round(time.time(), 3))
    log.event("run_end", step=step, status=status, final_loss=final_loss, best_metric=best)
    log.close()
    if cfg.logging.report_to:
        accelerator.end_training()
    counter.remove()
    notifier.notify(
        "finish" if exit_code == 0 else "interrupt",
        {"step": step, "total_steps": total_steps, "final_loss": final_loss, "best_metric": best},
    )
    notifier.close()
    if is_main:
        end_of_run_report(output_dir)
        print_summary(output_dir, status, step, total_steps, final_loss, best, cfg)
    return exit_code


# ---------------------------------------------------------------- helpers the loop calls


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


def stop_requested(stop: StopFlag, accelerator) -> bool:
    """Every rank must stop at the same step, so the flag is agreed on across processes."""
    flag = torch.tensor(1.0 if stop.signum is not None else 0.0, device=accelerator.device)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, "max")
    if flag > 0 and stop.signum is None:
        stop.signum = signal.SIGTERM
    return bool(flag > 0)


def metric_for_best(cfg: Config) -> MetricForBest:
    """The resolved ``eval.metric_for_best`` as the run-folder library's rule (readers apply the same)."""
    return MetricForBest(cfg.eval.metric_for_best, cfg.eval.greater_is_better)


def metric_value(eval_result: dict | None, cfg: Config):
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
    counter: ExpertCounter
    log: runlog.RunLog
    injector: OomInjector

    def loss_with_oom_fallback(self, step: int) -> dict | None:
        """An OOM while evaluating halves the evaluation batch; at batch 1 the evaluation is skipped, never fatal."""
        while True:
            try:
                self.injector.check("eval", step)
                return evaluate_loss(
                    self.model, self.val, self.cfg, self.accelerator, self.pad_id, forward_loss
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

    def run(self, step: int, best) -> dict | None:
        if not self.val and self.task is None:
            return None
        self.counter.stop()
        self.log.event("eval_start", step=step)
        result = {}
        if self.val:
            result = self.loss_with_oom_fallback(step)
            if result is None:
                return None
        if self.task is not None:
            generated = evaluate_generation(
                self.model, self.tokenizer, self.task, self.examples, self.cfg, self.accelerator
            )
            result.update(task=generated["task"], metrics=generated["metrics"], samples=generated["samples"])
        value = metric_value(result, self.cfg)
        is_best = best_is(value, best, self.cfg)
        self.log.append(EvalRecord.from_result(step, result, metric_for_best(self.cfg), is_best))
        self.log.event("eval_done", step=step, eval_loss=result.get("eval_loss"), metric_value=value)
        return {**result, "step": step}


def tracker_eval_metrics(result: dict) -> dict:
    metrics = {f"eval/{k}": v for k, v in (result.get("metrics") or {}).items()}
    if result.get("eval_loss") is not None:
        metrics["eval/loss"] = result["eval_loss"]
    return metrics


def trainer_state(step: int, pos: Position, last_eval, best, cfg: Config, shape: StepShape) -> dict:
    fresh = last_eval if last_eval and last_eval.get("step") == step else None
    return {
        "step": step,
        "epoch_index": pos.epoch,
        "rows_seen": pos.row,
        "metric": cfg.eval.metric_for_best,
        "metric_value": metric_value(fresh, cfg),
        "best_metric": best,
        "step_shape": shape.as_dict(),  # an OOM fallback's smaller shape survives a resume
    }


def save_and_retain(
    accelerator, model, tokenizer, cfg, output_dir, log, step, pos, last_eval, best, kind, shape
):
    """Save checkpoint-<step> (final-checkpoint-<step> for kind "final"), log it, update the best copy, prune."""
    state = trainer_state(step, pos, last_eval, best, cfg, shape)
    is_better = best_is(state["metric_value"], best, cfg)
    if is_better:
        state["best_metric"] = state["metric_value"]
    prefix = runlog.FINAL_PREFIX if kind == "final" else runlog.CHECKPOINT_PREFIX
    path = ckpt.save_checkpoint(accelerator, model, tokenizer, output_dir, f"{prefix}{step}", state)
    if not accelerator.is_main_process:
        return state["best_metric"]
    log.event(
        "checkpoint_saved",
        step=step,
        path=str(path),
        size_bytes=ckpt.folder_size(path),
        metric=cfg.eval.metric_for_best,
        metric_value=state["metric_value"],
        kind=kind,
    )
    if is_better or (kind == "final" and not (output_dir / runlog.BEST_ADAPTER_DIR).exists()):
        update_best(path, output_dir, log, step, cfg, state["metric_value"], best)
    for removed in ckpt.prune_checkpoints(output_dir, cfg.training.keep_top_k, cfg.eval.greater_is_better):
        log.event("checkpoint_pruned", step=runlog.checkpoint_step(removed.name), path=str(removed))
    return state["best_metric"]


def update_best(path, output_dir, log, step, cfg, value, best):
    target = ckpt.copy_best_adapter(path, output_dir)
    log.event(
        "best_updated", step=step, metric=cfg.eval.metric_for_best, metric_value=value, path=str(target)
    )
    return value if value is not None else best


def record_failure(log, exc: BaseException, step: int, accelerator) -> None:
    """Fatal errors go to error_log.jsonl and run.json before the exception propagates."""
    rank = accelerator.process_index if accelerator is not None else 0
    log.write(
        runlog.ERROR_LOG,
        {
            "step": step,
            "type": type(exc).__name__,
            "message": str(exc),
            "rank": rank,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        },
    )
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    if (log.output_dir / runlog.RUN_JSON).exists():
        log.update_run(status=status, step=step, ended_at=round(time.time(), 3))
    log.event("run_end", step=step, status=status, error=type(exc).__name__)
    log.close()


def length_report(cfg: Config, tokenizer, output_dir: Path, log, step: int) -> None:
    """Token-length distribution of (a sample of) the training file, logged at the start of every run."""
    from trainer.length_report import analyze, summary_line, write_data_report

    report = analyze(cfg, tokenizer, max_records=2000)
    write_data_report(report, output_dir)
    print(summary_line(report), flush=True)
    log.event(
        "length_report",
        step=step,
        lengths=report["lengths"],
        max_length=report["max_length"],
        truncation_lost_fraction=report["truncation_lost_fraction"],
        sampled=report["sampled"],
    )


def end_of_run_report(output_dir: Path) -> None:
    """HTML + PNG report in the run folder and an ASCII loss curve on the terminal; never fails the run."""
    from trainer.report import ReportError, ascii_loss_curve, write_report

    try:
        print(ascii_loss_curve(output_dir), flush=True)
        print(f"report: {write_report(output_dir)}", flush=True)
    except (ReportError, OSError, ValueError) as exc:
        print(f"report: not written ({exc})", flush=True)


def make_progress(enabled: bool, step: int, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


def flat_config(cfg: Config) -> dict:
    flat = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def announce(accelerator, cfg, loaded, data, total_steps, resume_from) -> None:
    if not accelerator.is_main_process:
        return
    r = loaded.report
    print(
        f"model: {cfg.model.name_or_path} ({loaded.family.name}/{loaded.model_type}, {cfg.training.method}) "
        f"params {r['total_params']:,}, trainable {r['trainable_params']:,}",
        flush=True,
    )
    if r["unquantized_expert_bytes"] and cfg.training.method == "qlora":
        print(
            f"WARNING: {r['unquantized_expert_bytes'] / 2**30:.2f} GiB of fused MoE expert weights are NOT "
            "4-bit quantized (bitsandbytes replaces nn.Linear only; see bitsandbytes issue 1849). "
            f"Unquantized total: {r['unquantized_bytes'] / 2**30:.2f} GiB.",
            flush=True,
        )
    d = data.report
    print(
        f"data: {d.train_records} train / {d.val_records} val records -> {d.train_sequences} / {d.val_sequences} "
        f"rows of {cfg.data.max_length} tokens (packing {'on' if d.packing else 'off'}; skipped lines {d.skipped_lines}; "
        f"truncation would lose {d.truncation_would_lose_tokens:,} tokens, lost {d.truncated_tokens:,})",
        flush=True,
    )
    where = (
        f"resuming from {resume_from.path} at step {resume_from.step}" if resume_from else "starting fresh"
    )
    print(f"training: {total_steps} steps on {accelerator.num_processes} process(es), {where}", flush=True)


def print_summary(
    output_dir: Path, status: str, step: int, total: int, final_loss, best, cfg: Config
) -> None:
    loss = f"{final_loss:.4f}" if isinstance(final_loss, float) else "n/a"
    best_text = f"{best:.4f}" if isinstance(best, float) else "n/a"
    print(
        f"\nrun {status} at step {step}/{total}; last loss {loss}; best {cfg.eval.metric_for_best} {best_text}"
    )
    print(f"run folder: {output_dir}")
    print(
        f"dashboard:  ./launch_dashboard.sh --logdir {output_dir.parent}   (then open http://localhost:5000)"
    )
