"""The training recipe: named set-up steps, then ``train()``, readable top to bottom.

forward -> backward (accumulate) -> clip -> step -> schedule -> log -> evaluate -> checkpoint.
The step itself (rows, micro-batches, the loss and token-normalised accumulation, and where a fast
path plugs in) is ``step.py``. Rank 0 writes the run folder; every rank trains.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import fastpath, peft_methods, runfolder
from trainer.config import Config
from trainer.data.dataset import prepare_data
from trainer.data.prepare import workers_of
from trainer.families import family_for
from trainer.model.loading import load_for_training, load_hf_config, load_tokenizer
from trainer.monitor.experts import ExpertCounter
from trainer.monitor.notify import Notifier
from trainer.monitor.telemetry import TelemetrySampler
from trainer.training import checkpoint_files as ckpt
from trainer.training import console, fsdp, run_status, trackers
from trainer.training.checkpointing import (
    Checkpointer,
    LoopState,
    find_resume_checkpoint,
    model_source,
    restore,
    skip_model_state,
)
from trainer.training.evaluation import Evaluator
from trainer.training.faults import NO_FAULTS, Faults
from trainer.training.figures import Figures, on_host_order
from trainer.training.oom_retry import OomFallback
from trainer.training.optim import make_optimizer, make_scheduler
from trainer.training.profiling import StepProfiler
from trainer.training.signals import StopFlag, Stopped
from trainer.training.step import Step, StepShape, choose_kernels, next_step_rows
from trainer.training.step_counts import reduce_with_loss
from trainer.training.step_log import StepDone, StepLog
from trainer.training.task_eval import load_task, resolve_metric

# ---------------------------------------------------------------- set-up steps


def make_accelerator(cfg: Config):
    """accelerate owns processes, devices and mixed precision; with training.distributed fsdp and several
    processes, also the sharding (FSDP2). One process has nothing to shard: it trains as it would anyway."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DataLoaderConfiguration, parse_flag_from_env

    plugin = None
    if fsdp.wanted(cfg):
        processes = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator would
        if processes.num_processes > 1:
            plugin = fsdp.make_plugin(cfg)
        else:
            print("training.distributed: fsdp with one process shards nothing; training as one process")
    accelerator = Accelerator(
        mixed_precision=cfg.training.mixed_precision,
        dataloader_config=DataLoaderConfiguration(non_blocking=cfg.performance.pin_memory),
        fsdp_plugin=plugin,
        **trackers.accelerator_kwargs(cfg),
    )
    if plugin is not None:
        fsdp.enable_on_cpu(accelerator, plugin)
    return accelerator


def prepare_output_dir(cfg: Config, accelerator) -> Path:
    """The run folder exists, without a crashed save's temporary folders; torch threads and TF32 set."""
    output_dir = Path(cfg.paths.output_dir).resolve()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_stale_temporaries(output_dir)
    accelerator.wait_for_everyone()
    if cfg.performance.torch_threads:
        torch.set_num_threads(cfg.performance.torch_threads)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.performance.tf32
        torch.backends.cudnn.allow_tf32 = cfg.performance.tf32
    return output_dir


def count_steps(cfg: Config, train_rows: int, world: int) -> int:
    micro, accum = cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps
    steps_per_epoch = train_rows // (micro * accum * world)
    if steps_per_epoch == 0:
        raise ValueError(
            f"paths.train_file: {train_rows} training rows, fewer than one optimizer step needs "
            f"({micro} x {accum} accumulation x {world} processes)"
        )
    return cfg.training.max_steps or math.ceil(cfg.training.num_epochs * steps_per_epoch)


def setup_optimizer(model, cfg: Config, accelerator, total_steps: int, loaded_in_shards: bool = False):
    """Optimizer and schedule, prepared by accelerate; its checkpoints hold them but not the weights."""
    optimizer = make_optimizer(model, cfg, accelerator.device.type == "cuda")
    scheduler = make_scheduler(optimizer, cfg, total_steps)
    names = fsdp.optimizer_names(model, optimizer) if loaded_in_shards else None
    layer_classes = fsdp.prepare_wrapping(accelerator, model, cfg) if fsdp.active(accelerator) else []
    model, optimizer = accelerator.prepare(model, optimizer)
    if names is not None:
        fsdp.remap_optimizer(model, optimizer, names)
    if fsdp.active(accelerator):
        fsdp.after_prepare(model)
        fsdp.forward_prefetch(model, layer_classes, cfg.fsdp.forward_prefetch)
        if cfg.fsdp.reshard_after_forward:
            fsdp.keep_last_layer_gathered(model, layer_classes)
    accelerator.register_for_checkpointing(scheduler)
    skip_model_state(accelerator)
    return model, optimizer, scheduler


@dataclass
class Run:
    """What set-up builds for the loop."""

    cfg: Config  # as resolved (eval.metric_for_best chosen)
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    train_rows: int
    rows_per_step: int  # micro-batch x accumulation x processes, whatever the OOM fallback's shape
    total_steps: int
    step: Step
    evaluator: Evaluator
    checkpointer: Checkpointer
    oom: OomFallback
    counter: ExpertCounter
    notifier: Notifier
    trackers: trackers.Trackers


def set_up(cfg, accelerator, output_dir, log, resume_from, state: LoopState, config_source, faults) -> Run:
    """Model and the step's kernels, data, optimizer, the loop's helpers; resume; then open the run."""
    from accelerate.utils import set_seed

    # Data first (after the model's config, which names its family and whether it packs): its errors show
    # before a long model load, and its worker processes fork from a small process. The first process to
    # get here builds the cache; the others wait for it and reuse it.
    family = family_for(getattr(load_hf_config(cfg), "model_type", "") or "", cfg.model.family)
    data = prepare_data(cfg.paths, cfg.data, load_tokenizer(cfg), family.packing, workers_of(cfg.performance))
    set_seed(cfg.training.seed)
    loaded = load_for_training(model_source(cfg, resume_from), accelerator.device)
    kernels = choose_kernels(loaded, cfg, accelerator.device)
    tokenizer, is_main = loaded.tokenizer, accelerator.is_main_process
    task, task_examples = load_task(cfg)
    cfg = resolve_metric(cfg, task)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    world = accelerator.num_processes
    rows_per_step = cfg.training.micro_batch_size * cfg.training.gradient_accumulation_steps * world
    total_steps = count_steps(cfg, len(data.train), world)
    # LoRA-GA's init, SDLoRA's stage one and masks: once per run folder, before the optimizer sees the weights.
    peft_methods.prepare(loaded, cfg, data, pad_id, kernels.loss, accelerator, output_dir, log)
    if fsdp.wanted(cfg):
        print(fsdp.loading_line(accelerator, loaded.model, loaded.shards), flush=True)
    model, optimizer, scheduler = setup_optimizer(
        kernels.prepare(loaded.model), cfg, accelerator, total_steps, loaded.shards is not None
    )
    if loaded.shards is not None:  # loaded in shards: each rank fills its own now that FSDP cut them
        fsdp.fill_loaded_shards(accelerator, loaded.shards, cfg.fsdp.cpu_offload)
    if fsdp.active(accelerator):
        print(fsdp.sharded_line(accelerator, model), flush=True)
    counter = ExpertCounter(accelerator.unwrap_model(model))
    loss = faults.loss(kernels.loss)
    aux_coef = float(getattr(accelerator.unwrap_model(model).config, "router_aux_loss_coef", 0.0) or 0.0)
    # Several processes: gradients synced after the ranks agree no rank ran out of memory. Not for full
    # fine-tuning, whose gradients are the model's size: there DDP's all-reduce overlapping backward is kept.
    # Nor under FSDP, whose gradients are reduce-scattered into shards during backward.
    # The same decision lets several processes replay CUDA graphs (fastpath.graphs_unavailable), whose gradients
    # DDP's hooks would not see: the two must agree, hence one method.
    coordinated_oom = cfg.grads_synced_after_step(world) and not fsdp.active(accelerator)
    step = Step(model, accelerator, loss, counter, aux_coef, data.train, pad_id, coordinated_oom)
    graphs = fastpath.layer_graphs_of(accelerator.unwrap_model(model))
    if graphs is not None and is_main:  # the run folder says when the layers start replaying, or stop
        graphs.on_change = lambda state, detail: log.event("cuda_graphs", state=state, detail=detail)
    evaluator = Evaluator(
        model, tokenizer, data.val, task, task_examples, cfg, accelerator, pad_id, loss, counter, log, faults
    )
    checkpointer = Checkpointer(
        accelerator, model, tokenizer, cfg, output_dir, log, faults, optimizer, scheduler
    )
    oom = OomFallback(cfg, log, optimizer, world, is_main, faults, model if coordinated_oom else None)
    if resume_from is not None:
        restore(resume_from, accelerator, model, state, optimizer, scheduler)

    notifier, tracking = open_run(
        cfg, accelerator, output_dir, log, loaded, data, total_steps, state.step, resume_from, config_source
    )
    return Run(
        cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler, train_rows=len(data.train),
        rows_per_step=rows_per_step, total_steps=total_steps, step=step, evaluator=evaluator,
        checkpointer=checkpointer, oom=oom, counter=counter, notifier=notifier, trackers=tracking,
    )  # fmt: skip


def open_run(cfg, accelerator, output_dir, log, loaded, data, total_steps, step, resume_from, config_source):
    """run.json and the opening events, the console's summary and length report, notifications, trackers."""
    is_main = accelerator.is_main_process
    run_status.start_run(
        log,
        cfg,
        output_dir,
        loaded,
        data,
        accelerator.num_processes,
        total_steps,
        step,
        resume_from,
        config_source,
    )
    console.announce(accelerator, cfg, loaded, data, total_steps, resume_from)
    if is_main:
        console.length_report(data.length_report, output_dir, log, step)
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
    return notifier, trackers.Trackers(accelerator, cfg).start(output_dir.name, cfg)


def start_monitoring(cleanup, run: Run, log, accelerator, output_dir: Path, state: LoopState) -> StepLog:
    """Expert hooks, telemetry sampler and progress bar, each released by ``cleanup``."""
    cfg = run.cfg
    cleanup.callback(run.counter.remove)
    telemetry = TelemetrySampler(
        output_dir, cfg.logging.telemetry_interval, enabled=accelerator.is_local_main_process
    )
    telemetry.start()
    cleanup.callback(telemetry.stop)
    step_log = StepLog(
        cfg, log, accelerator, run.counter, run.trackers, run.notifier, run.total_steps, run.train_rows, state
    )
    cleanup.callback(step_log.close)
    return step_log


def step_figures(accelerator, model, result, cfg: Config, stop_asked: bool):
    """The step's mean loss (all ranks) and its gradient norm after clipping, left on the device, with the
    values every rank reads alike (``step_counts.py``) and how they read."""
    loss, shared, counts = reduce_with_loss(accelerator, result, stop_asked)
    max_norm = cfg.optimization.max_grad_norm or float("inf")
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    return loss, grad_norm, shared, counts


def read_figures(loss, grad_norm, shared) -> list[float]:
    """The figures and the shared values on the host in one sync: reading them one by one would wait on the GPU
    again and again."""
    if not torch.is_tensor(grad_norm):  # some backends hand back a float
        grad_norm = torch.tensor(float(grad_norm), device=loss.device)
    return on_host_order(loss, grad_norm, shared).tolist()


def skips_on_device(optimizer, cfg: Config):
    """The optimizer that can skip a non-finite step by itself, on the device (PyTorch's fused AdamW reads a
    ``found_inf`` tensor, as GradScaler hands it one), or None: fp16 (the scaler sets it) and every other
    optimizer keep the host's decision. FSDP's sharded (DTensor) parameters take it too, as a 0-dim tensor (a
    1-element one fails to broadcast there: torch 2.11 on CUDA, bench/RESULTS.md session 35)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if cfg.training.mixed_precision == "fp16":
        return None
    if isinstance(inner, torch.optim.AdamW) and inner.defaults.get("fused"):
        return inner
    return None


def update(
    accelerator, model, optimizer, result, cfg: Config, meanwhile=lambda: None, stop_asked: bool = False
) -> Figures:
    """Clip and step, unless the step is non-finite; returns its ``Figures`` (the loss, the gradient norm, why
    the update was skipped, and the step's counts, with whether any rank was asked to stop: ``stop_asked`` is
    this rank's say). ``meanwhile`` is the host's work that needs neither figure (the schedule, the next step's
    batches): it runs after the update is queued.

    Where the optimizer can skip on the device (``skips_on_device``), it gets the decision as a tensor and is
    stepped before the host reads the figures, which are copied to the host behind the update and read when
    the caller asks (``figures.py``): the GPU does not sit idle while the host steps the optimizer and builds
    the next batch (5.4 and 4.5 ms of a graphed Llama-1B step's 19 ms of idle, bench/RESULTS.md session 30),
    nor, read a step late, while it logs. Elsewhere the host reads the figures first and skips the call."""
    loss, grad_norm, shared, counts = step_figures(accelerator, model, result, cfg, stop_asked)
    inner = skips_on_device(optimizer, cfg) if torch.is_tensor(grad_norm) else None
    if inner is None:
        read_loss, read_norm, *read_shared = read_figures(loss, grad_norm, shared)
        skipped = skip_reason(read_loss, read_norm, cfg)
        if skipped is None:
            optimizer.step()
        meanwhile()
        return Figures.known(read_loss, read_norm, skipped, counts(read_shared))
    finite = torch.isfinite(loss.detach().float()) & torch.isfinite(
        grad_norm.detach().float().to(loss.device)
    )
    inner.found_inf = (~finite).float().reshape(())  # skip_reason's rule (fp16 excluded); 0-dim for DTensors
    try:
        optimizer.step()
    finally:
        del inner.found_inf
    meanwhile()
    return Figures.behind(loss, grad_norm, shared, functools.partial(skip_reason, cfg=cfg), counts)


def read_late(step: int, run: Run, due: bool) -> bool:
    """Whether this step's figures may wait until the next step's passes are queued: nothing at this step reads
    them (an evaluation, a checkpoint, the last step). With several processes every rank decides alike, so all
    read the same step's stop flag at the same point."""
    return not due and step < run.total_steps


def between_steps(run: Run, state: LoopState) -> None:
    """What follows an update whatever its figures: the schedule, cleared gradients, the next step's batches."""
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if state.step < run.total_steps:
        rows, _ = next_step_rows(run.train_rows, run.rows_per_step, run.cfg.training.seed, state.pos)
        run.step.prefetch(rows, state.shape)


def skip_reason(loss: float, grad_norm: float, cfg: Config) -> str | None:
    """Why this step must not update the weights, or None."""
    if not math.isfinite(loss):
        return "nonfinite_loss"
    if not math.isfinite(grad_norm) and cfg.training.mixed_precision != "fp16":
        return "nonfinite_grad_norm"  # fp16: the grad scaler skips and lowers its scale itself
    return None


def freeze_setup_objects() -> None:
    """Move everything set-up built (the model, the data rows, imported modules) out of Python's cyclic GC.

    Each step allocates thousands of Python objects (autograd nodes, tensors), so the collector runs often; a
    full collection would walk every long-lived object each time, stalling the host that launches kernels.
    What set-up built lives for the whole run anyway."""
    gc.collect()
    gc.freeze()


def eval_due(step: int, total_steps: int, cfg: Config) -> bool:
    return step % cfg.eval.interval == 0 or (step == total_steps and cfg.eval.at_end)


def evaluate(run: Run, state: LoopState, stop: StopFlag, accelerator) -> None:
    """Evaluate this step, checking for a stop between batches; a cut evaluation is left pending, and the
    checkpoint saved next records that, so a resume evaluates this step again before training on."""
    try:
        check = functools.partial(stop.check, accelerator)
        state.last_eval = run.evaluator.run(state.step, state.best, check)
        state.eval_pending = False
        run.trackers.log_eval(state.step, state.last_eval)
    except Stopped:
        state.last_eval, state.eval_pending = None, True


# ---------------------------------------------------------------- the loop


def train(
    cfg: Config, resume: str | None = None, config_source: str | None = None, faults: Faults = NO_FAULTS
) -> int:
    """Run training; returns the process exit code (0 done, 130/143 stopped by a signal).

    ``faults`` lets tests break the run on purpose (see faults.py); production passes nothing."""
    accelerator = make_accelerator(cfg)
    output_dir = prepare_output_dir(cfg, accelerator)
    resume_from = find_resume_checkpoint(cfg, resume, output_dir)
    log = runfolder.RunLog(output_dir, enabled=accelerator.is_main_process)
    state = LoopState(StepShape(cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps))
    run: Run | None = None
    stop = StopFlag()  # during set-up a signal stops at once; from here on, at agreed points (signals.py)
    exit_code = 0
    try:
        # Released first on every ending (finish, signal, error), before run.json says how it ended.
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(stop.install().restore)
            run = set_up(cfg, accelerator, output_dir, log, resume_from, state, config_source, faults)
            cfg, model, optimizer, scheduler = run.cfg, run.model, run.optimizer, run.scheduler
            step_log = start_monitoring(cleanup, run, log, accelerator, output_dir, state)
            stop.immediate = False  # the run is open: a signal now ends in a checkpoint and run.json's status
            freeze_setup_objects()
            cleanup.callback(
                gc.unfreeze
            )  # a process that trains again (tests, sweeps) can free this run's objects

            model.train()
            if state.eval_pending or (cfg.eval.at_start and state.step == 0):
                cut_short = state.eval_pending
                evaluate(run, state, stop, accelerator)
                if cut_short and not state.eval_pending and state.step < run.total_steps:
                    # The checkpoint the signal saved, again with its evaluation, so best and top-K see it.
                    run.checkpointer.save("signal", state)
            if stop.requested(accelerator):  # before the first step: nothing new to save
                log.event("signal", step=state.step, signal=stop.name)
                exit_code = stop.exit_code
            profiler = StepProfiler(
                output_dir,
                accelerator.process_index,
                cfg.performance.profile_from,
                cfg.performance.profile_steps,
            )
            if cfg.performance.profile_from > run.total_steps:
                print(
                    f"WARNING: performance.profile_from: {cfg.performance.profile_from} is past this run's last "
                    f"step ({run.total_steps}); nothing is profiled",
                    flush=True,
                )
            while not exit_code and state.step < run.total_steps:
                started = time.time()
                profiler.before(state.step + 1)
                rows, state.pos = next_step_rows(
                    run.train_rows, run.rows_per_step, cfg.training.seed, state.pos
                )
                result, state.shape = run.oom.run(
                    state.step,
                    state.shape,
                    functools.partial(run.step, rows),
                    save_before_failing=lambda: step_log.flush() or run.checkpointer.save("oom", state),
                )
                step_log.flush()  # the step before, where its figures were left to read until now
                state.step += 1
                # The update: clip, skip a non-finite step (inline, where the reader sees it), step, schedule.
                lr = scheduler.get_last_lr()[0]
                figures = update(
                    accelerator,
                    model,
                    optimizer,
                    result,
                    cfg,
                    functools.partial(between_steps, run, state),
                    stop_asked=stop.asked,
                )
                should_save = state.step % cfg.training.save_steps == 0 and state.step < run.total_steps
                should_eval = should_save or eval_due(state.step, run.total_steps, cfg)
                done = StepDone(state.step, state.pos, lr, started, figures)
                step_log.finish(done, read_now=not read_late(state.step, run, should_eval))
                profiler.after(state.step)

                if should_eval:
                    evaluate(run, state, stop, accelerator)
                if should_save:
                    run.checkpointer.save("periodic", state)
                # Several processes agree through the stop flag reduced with the last step read (step_counts.py).
                if stop.requested(accelerator, agreed=step_log.agreed_stop):
                    step_log.flush()
                    log.event("signal", step=state.step, signal=stop.name)
                    if not should_save:
                        run.checkpointer.save("signal", state)
                    exit_code = stop.exit_code
                    break
                if state.step % 10 == 0:
                    log.update_run(step=state.step)
            profiler.close(state.step)
            if not exit_code:
                run.checkpointer.save("final", state)
    except Stopped:  # raised by the signal handler during set-up: no run is open, nothing new to save
        print(f"stopped by {stop.name} during set-up; nothing to save", flush=True)
        return stop.exit_code
    except BaseException as exc:
        end_with_error(exc, log, state, accelerator, run)
        raise
    end(exit_code, log, state, accelerator, run, output_dir)
    return exit_code


# ---------------------------------------------------------------- the two endings


def end_with_error(exc: BaseException, log, state: LoopState, accelerator, run: Run | None) -> None:
    """A failure (or a second Ctrl-C): error_log.jsonl and run.json first, then trackers and notifications."""
    run_status.record_failure(log, exc, state.step, accelerator.process_index)
    if run is not None:
        run.trackers.end()
        run.notifier.notify("failure", {"step": state.step, "error": f"{type(exc).__name__}: {exc}"})
        run.notifier.close()


def end(exit_code: int, log, state: LoopState, accelerator, run: Run, output_dir: Path) -> None:
    """Finished, or stopped by a signal after its checkpoint: run.json, trackers, notifications, report."""
    status = "finished" if exit_code == 0 else "interrupted"
    run_status.end_run(log, status, state.step, state.final_loss, state.best)
    run.trackers.end()
    run.notifier.notify(
        "finish" if exit_code == 0 else "interrupt",
        {
            "step": state.step,
            "total_steps": run.total_steps,
            "final_loss": state.final_loss,
            "best_metric": state.best,
        },
    )
    run.notifier.close()
    if accelerator.is_main_process:
        console.end_of_run_report(output_dir)
        console.print_summary(
            output_dir, status, state.step, run.total_steps, state.final_loss, state.best, run.cfg
        )
