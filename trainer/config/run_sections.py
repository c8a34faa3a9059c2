"""The sections that say how a run goes about it rather than what it trains: evaluation, logging, memory,
FSDP sharding, performance switches and notifications. ``trainer.config.sections`` assembles them into
``Config`` with the others; see its docstring."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from trainer.config.fields import SECTION, Bool, Float, Int, Str, limit, rule


@dataclass(config=SECTION)
class EvalConfig:
    """Evaluation: validation loss, task metrics by generation, the metric that picks the best (docs/tasks.md)."""

    interval: Int = limit(50, gt=0)
    """Evaluate every this many optimizer steps."""
    batch_size: Int = limit(8, gt=0)
    """Validation rows per batch (halved on an out-of-memory error, in a one-process run)."""
    max_batches: Int = 0
    """Validation batches per evaluation; 0: all."""
    at_start: Bool = False
    """Also evaluate before the first step."""
    at_end: Bool = True
    """Also evaluate after the last step."""
    metric_for_best: Str = "auto"
    """The metric that ranks evaluations (the best checkpoint, keep_top_k): eval_loss or a task metric; auto:
    the task's official metric when eval.task is set, else eval_loss."""
    greater_is_better: Bool | None = None
    """Direction of metric_for_best; null: follows the metric (lower for losses, higher otherwise)."""
    task: Str | None = None
    """Generation-based evaluation on a task (trainer/tasks): a GLUE task's name, or spider; null: none."""
    task_data_dir: Str | None = None
    """The task's data folder (GLUE: download_glue_data.py's; null reads the Hub); spider requires one."""
    task_split: Str = "validation"
    """The task's split that is evaluated."""
    task_max_examples: Int = 0
    """The task's examples evaluated (the first ones); 0: all."""
    max_new_tokens: Int | None = limit(None, gt=0)
    """Tokens generated at most per answer; null: the task's own."""
    min_new_tokens: Int = 0
    """Tokens generated at least per answer."""
    num_beams: Int = limit(1, ge=1)
    """Beam search width; 1: greedy decoding."""
    generation_batch_size: Int = limit(8, gt=0)
    """Prompts per generate() call (left-padded)."""
    max_total_length: Int | None = None
    """Limit on prompt plus answer tokens, below the model's position limit; null: that limit alone."""
    sql_timeout_s: Float = limit(5.0, gt=0, allow_inf_nan=False, note="seconds")
    """Wall-clock limit for executing one SQL query (text-to-SQL execution match)."""

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str | None) -> str | None:
        from trainer.tasks import TASK_NAMES  # standard library only; imported late to keep config light

        if value is not None and value.lower().replace("-", "") not in TASK_NAMES:
            raise rule(f"expected one of {', '.join(TASK_NAMES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _spider_has_data(self) -> EvalConfig:
        if self.task == "spider" and self.task_data_dir is None:
            raise rule(
                "spider needs a folder with tables.json, database/ and the question files",
                "task_data_dir",
                "task",
            )
        return self


@dataclass(config=SECTION)
class LoggingConfig:
    """How often the run folder's logs are written (docs/run-folder.md), the progress bar, trackers."""

    interval: Int = limit(1, gt=0)
    """A training_log.jsonl record every this many optimizer steps."""
    expert_interval: Int = limit(10, gt=0)
    """MoE router statistics (expert_usage_log.jsonl) every this many optimizer steps."""
    telemetry_interval: Float = limit(10.0, gt=0, note="seconds")
    """Seconds between GPU/CPU telemetry samples (gpu_log.jsonl)."""
    progress_bar: Bool = True
    """Show the console progress bar (rank 0)."""
    report_to: list[Str] = Field(default_factory=list)
    """accelerate trackers that get the metrics too (tensorboard, wandb, mlflow, ...), their files in the run
    folder's trackers/ (docs/operations.md)."""


@dataclass(config=SECTION)
class MemoryConfig:
    """What trades speed for memory, and what happens on an out-of-memory error."""

    gradient_checkpointing: Bool = False
    """Recompute each layer's activations in backward (non-reentrant) instead of keeping them."""
    offload_checkpoints: Bool = True
    """With checkpointing on the CUDA fast path (LoRA, QLoRA): each layer's input waits in pinned host memory
    until its backward, copied on a side stream (trainer/fastpath/offload.py)."""
    chunked_loss: Bool = True
    """Cross-entropy in checkpointed chunks of tokens, never the full fp32 logits (plain-head causal LMs)."""
    oom_fallback: Bool = True
    """On a CUDA out-of-memory error in a training step, halve the micro-batch and double accumulation (same
    effective batch) and redo the step. (Evaluation halves its batch on one either way, in a one-process run.)"""
    max_oom_retries: Int = limit(3, ge=0)
    """Fallbacks tried before the run saves a checkpoint and fails."""


@dataclass(config=SECTION)
class FsdpConfig:
    """FSDP2 settings, read when training.distributed is fsdp (trainer/training/fsdp.py, docs/fsdp.md)."""

    reshard_after_forward: Bool = True
    """Free each layer's gathered weights after its forward (gathered again for backward): less memory, one
    more all-gather per layer. false keeps them until backward (ZeRO-2-like). The last decoder layer keeps
    them either way: its backward follows right after the head."""
    forward_prefetch: Int = limit(1, ge=0)
    """How many FSDP units ahead of itself each one starts gathering in forward, as it begins (the embedding,
    then the decoder layers, then the head). 0 is torch's implicit prefetch: the next unit's all-gather is
    issued only when the host reaches it, which overlaps nothing while the GPU waits on the host. 1 holds no
    more gathered than torch's default; each one more holds one more layer."""
    cpu_offload: Bool = False
    """Sharded parameters, gradients and optimizer state live in host memory; the optimizer steps on the CPU."""
    activation_checkpointing: Bool = False
    """Recompute each decoder layer in backward, applied by FSDP around the wrapped layers (instead of
    memory.gradient_checkpointing, which the model applies itself)."""
    cpu_ram_efficient_loading: Bool = False
    """Every rank loads (QLoRA: quantizes) one tensor at a time and keeps only its own shard, so none holds
    the whole model (trainer/model/sharded_loading.py): QLoRA, LoRA and full fine-tuning."""
    wrap_classes: list[Str] | None = None
    """The module classes that become one FSDP unit each; null: the model's decoder layer (_no_split_modules)."""


@dataclass(config=SECTION)
class PerformanceConfig:
    """Speed: TF32, the CUDA fast path, data preparation's processes, CPU threads."""

    tf32: Bool = True
    """Let float32 matmuls use TF32 tensor cores (CUDA)."""
    fast_path: Literal["auto", "on", "off"] = "auto"
    """CUDA fast path for causal LMs, and its LoRA, norm and loss pieces for Mamba on a fast kernel path
    (trainer/fastpath, docs/fastpath.md): auto takes it where it applies, on insists, off never."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Replay decoder layers from CUDA graphs: one launch where Python made hundreds. With
    memory.offload_checkpoints, each checkpointed layer's forward, and its recompute with backward, captured at
    its second call (trainer/fastpath/layer_graphs.py); without checkpointing, every layer's forward and
    backward, captured at the second training forward of a shape (trainer/fastpath/stack_graphs.py; causal
    LMs on the fast path, GLA on its checked Triton kernels; with data.packing, since unpacked batches change
    width). Several processes only under DDP with LoRA-style methods and memory.oom_fallback (their gradients
    averaged once after the step: DDP's hooks would not see a graph's); layers with dropout or hooks,
    other shapes and calls the family marks (GLA's packed rows) run eagerly; after a graphed stack's capture, a
    training batch of another shape or mask runs eagerly under activation checkpointing. auto takes it where it applies, on insists (exit 2 where it cannot
    apply), off never."""
    data_workers: Int = limit(0, ge=0)
    """Processes that tokenize and pack the data into its cache (once per data, tokenizer and settings);
    0: one per CPU core this process may use, at most 16."""
    dataloader_num_workers: Int = limit(0, ge=0, note="the older name of data_workers, used when that is 0")
    """The older name of data_workers, used when that is 0."""
    pin_memory: Bool = False
    """accelerate's non_blocking for the data loaders it prepares; the loop prepares none (it copies its
    batches itself), so this changes nothing today. Old launch scripts' PIN_MEMORY maps here."""
    torch_threads: Int = 0
    """torch's CPU threads (torch.set_num_threads); 0: torch's default."""
    profile_from: Int = limit(0, ge=0)
    """Profile optimizer steps with torch.profiler from this step on (1 is the first); 0: never. Every process
    writes profile/rank<N>-steps<A>-<B>.trace.json (Perfetto, chrome://tracing) and a .txt beside it (time by
    op and kernel) into the run folder (trainer/training/profiling.py)."""
    profile_steps: Int = limit(2, gt=0)
    """How many optimizer steps profile_from profiles."""


@dataclass(config=SECTION)
class NotifyConfig:
    """Notifications of a run's start, end and stalls, by webhook and e-mail (docs/operations.md)."""

    webhook_url: Str | None = None
    """A URL that takes each event as a JSON POST (Slack-style text); null: no webhook."""
    email_config: Str | None = None
    """A file of SMTP settings (YAML or INI) to e-mail each event too; null: no e-mail."""
    events: list[Str] = Field(default_factory=lambda: ["start", "finish", "failure", "interrupt", "stall"])
    """The events that notify: start, finish, failure, interrupt, stall."""
    stall_minutes: Float = limit(30.0, gt=0)
    """Minutes without a finished optimizer step before the stall event fires."""
    timeout_seconds: Float = 10.0
    """The longest the trainer waits for all channels together, per event."""
