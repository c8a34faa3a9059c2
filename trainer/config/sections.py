"""The config's sections as pydantic dataclasses: every key, its type, default, bounds and cross-key rules.

These types are the whole validation of values (``trainer.config.load`` reads the YAML, applies
``--set`` overrides and checks the files), and ``dataclasses.replace``/``asdict`` keep working on them.
A broken rule becomes a ``ConfigError`` line worded by trainer/config/errors.py; docs/config.md lists
every key.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; a number field takes it as the number it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# Nothing is guessed: "5" is not an integer, 1 is not true. An integer is accepted for a number.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Float = Annotated[float, Strict(), BeforeValidator(_yaml_number)]


def limit(default: Any, *, note: str = "", what: str = "", **bounds: Any) -> Any:
    """A field with bounds (gt/ge/lt/le); ``what`` and ``note`` shape the error: ``expected a rank > 0``."""
    extra = {k: v for k, v in (("note", note), ("what", what)) if v}
    return Field(default, **bounds, json_schema_extra=extra or None)


def rule(message: str, key: str = "", *blame: str) -> PydanticCustomError:
    """A cross-key rule broken: ``key`` (relative to the section) is named, ``blame`` may have set it."""
    return PydanticCustomError("config_rule", "{message}", {"message": message, "key": key, "blame": blame})


SECTION = ConfigDict(extra="forbid")


@dataclass(config=SECTION)
class PathsConfig:
    output_dir: Str = "runs/default"
    train_file: Str = "data/tiny_corpus.jsonl"
    val_file: Str | None = None
    cache_dir: Str | None = None


@dataclass(config=SECTION)
class ModelConfig:
    name_or_path: Str = "configs/tiny-moe"
    family: Literal["auto", "causal", "gla", "mamba"] = "auto"
    random_init: Bool = False
    tokenizer: Str | None = None
    revision: Str | None = None
    trust_remote_code: Bool = False
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    attn_implementation: Str | None = None
    # The implementation that runs the sequence mixing (trainer/model/kernel_choice.py): auto takes the best
    # one that runs here and passes its start-up self-check; a name forces it (and a failed check stops the
    # run). Each family has its own names (their kernel_paths): causal transformers; GLA fla-triton,
    # fla-naive-torch; Mamba mamba_ssm, fla-triton-ssd (Mamba-2), mambapy (Mamba-1), torch-reference.
    kernel_path: Literal[
        "auto", "transformers", "fla-triton", "fla-naive-torch", "mamba_ssm", "fla-triton-ssd", "mambapy",
        "torch-reference",
    ] = "auto"  # fmt: skip


@dataclass(config=SECTION)
class DataConfig:
    # auto: chat when the first record has messages_field (or ShareGPT's "conversations"), instruction when
    # it has prompt_field and response_field, text otherwise.
    format: Literal["auto", "text", "instruction", "chat"] = "auto"
    text_field: Str = "text"
    prompt_field: Str = "prompt"
    response_field: Str = "response"
    # chat: a list of {"role", "content"} turns (ShareGPT's {"from", "value"} are mapped), rendered with the
    # tokenizer's chat template (chat_template overrides it: a Jinja string or a file); loss on assistant turns.
    messages_field: Str = "messages"
    system_prompt: Str | None = None  # chat: a system turn for records that have none
    chat_template: Str | None = None
    # A Hugging Face dataset instead of paths.train_file: a Hub id or a local folder load_dataset reads
    # (offline once cached), with its config name, split, revision; val_split names the validation split.
    dataset: Str | None = None
    dataset_config: Str | None = None
    dataset_split: Str = "train"
    dataset_revision: Str | None = None
    val_split: Str | None = None
    # Where tokenized, packed rows are cached (one folder per fingerprint); null: ~/.cache/finetune-kit/data
    # (or $FINETUNE_KIT_DATA_CACHE). `python -m trainer cache list|clear` shows and removes them.
    cache_dir: Str | None = None
    max_length: Int = limit(256, ge=8)
    packing: Bool = True
    long_documents: Literal["split", "truncate"] = "split"
    val_fraction: Float = limit(0.05, ge=0, lt=1)
    seed: Int = 42
    on_bad_line: Literal["skip", "fail"] = "skip"
    add_eos: Bool = True


@dataclass(config=SECTION)
class TrainingConfig:
    method: Literal["qlora", "lora", "full"] = "lora"
    max_steps: Int = limit(0, ge=0, note="0 = use num_epochs")
    num_epochs: Float = 1.0
    micro_batch_size: Int = limit(8, gt=0)
    gradient_accumulation_steps: Int = limit(1, gt=0)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    seed: Int = 42
    save_steps: Int = limit(50, gt=0)
    keep_top_k: Int = limit(2, ge=1)
    resume: Literal["auto", "never"] = "auto"
    # ddp: every process holds the whole model. fsdp: parameters, gradients and optimizer state are sharded
    # across the processes (PyTorch FSDP2 through accelerate; the fsdp section; docs/fsdp.md).
    distributed: Literal["ddp", "fsdp"] = "ddp"

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.max_steps == 0 and self.num_epochs <= 0:
            raise rule("expected > 0 when max_steps is 0", "num_epochs", "max_steps")
        return self


@dataclass(config=SECTION)
class OptimizationConfig:
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = "adamw"
    learning_rate: Float = limit(2e-4, gt=0)
    weight_decay: Float = limit(0.0, ge=0)
    adam_beta1: Float = 0.9
    adam_beta2: Float = 0.999
    adam_epsilon: Float = 1e-8
    max_grad_norm: Float = limit(1.0, ge=0, note="0 disables")
    lr_scheduler: Literal["constant", "linear", "cosine", "polynomial"] = "cosine"
    warmup_ratio: Float = limit(0.0, ge=0, lt=1)
    warmup_steps: Int = limit(0, ge=0)
    polynomial_power: Float = 1.0
    min_lr_ratio: Float = limit(0.0, ge=0, le=1)


LORA_INITS = ("default", "gaussian", "pissa", "olora", "loftq", "lora_ga")


@dataclass(config=SECTION)
class LoraConfig:
    r: Int = limit(16, gt=0, what="a rank")
    alpha: Int = limit(32, gt=0)
    dropout: Float = limit(0.05, ge=0, lt=1)
    target_modules: list[Str] | Str | None = None
    target_parameters: list[Str] | None = None
    variant: Literal["lora", "dora", "rslora"] = "lora"
    init: Str = "default"
    bias: Literal["none", "all", "lora_only"] = "none"
    # lora: adapters only. sdlora (Mamba): adapters plus a selected few SSM channels/states (docs/families.md).
    method: Literal["lora", "sdlora"] = "lora"
    # LoRA-GA (init: lora_ga): micro-batches of the training data whose accumulated gradient is factorised,
    # and the paper's stable-scale gamma.
    lora_ga_batches: Int = limit(8, gt=0)
    lora_ga_gamma: Float = limit(16.0, gt=0)
    # SDLoRA: fractions of SSM channels, and of states per selected channel, that train in stage two;
    # stage one's optimizer steps and its data (null: the training file); the SSM parameters (null: the
    # model type's default).
    sdlora_channels: Float = limit(0.01, gt=0, le=1, what="a fraction")
    sdlora_states: Float = limit(0.05, gt=0, le=1, what="a fraction")
    sdlora_stage_one_steps: Int = limit(20, gt=0)
    sdlora_stage_one_file: Str | None = None
    sdlora_params: list[Literal["A_log", "BC", "D", "dt", "conv"]] | None = None

    @field_validator("init")
    @classmethod
    def _known_init(cls, value: str) -> str:
        if value not in LORA_INITS and not value.startswith("pissa_niter_"):
            raise rule(
                f"expected default, gaussian, pissa, pissa_niter_N, olora, loftq or lora_ga, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _lora_ga_fits(self) -> LoraConfig:
        if self.init != "lora_ga":
            return self
        if self.variant == "dora":
            raise rule(
                "lora_ga sets A and B from the gradient, which DoRA's magnitude vector would rescale; "
                "use lora.variant lora or rslora",
                "init",
                "variant",
            )
        if self.target_parameters:
            raise rule(
                "lora_ga factorises the gradients of Linear weights; lora.target_parameters (fused 3-D "
                "expert weights) cannot take it",
                "init",
                "target_parameters",
            )
        if self.method == "sdlora":
            raise rule("lora_ga does not combine with lora.method sdlora yet; pick one", "init", "method")
        return self


@dataclass(config=SECTION)
class QuantizationConfig:
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: Bool = True
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    skip_modules: list[Str] = Field(default_factory=lambda: ["lm_head"])
    # Fused 3-D MoE expert weights escape bitsandbytes' Linear replacement; quantize them too.
    quantize_experts: Bool = True


@dataclass(config=SECTION)
class EvalConfig:
    interval: Int = limit(50, gt=0)
    batch_size: Int = limit(8, gt=0)
    max_batches: Int = 0
    at_start: Bool = False
    at_end: Bool = True
    # auto: the task's official metric when eval.task is set, else eval_loss. greater_is_better unset
    # (null) follows the metric: lower for losses, higher otherwise.
    metric_for_best: Str = "auto"
    greater_is_better: Bool | None = None
    # Generation-based evaluation on a task (trainer/tasks): glue names, or spider.
    task: Str | None = None
    task_data_dir: Str | None = None
    task_split: Str = "validation"
    task_max_examples: Int = 0
    max_new_tokens: Int | None = limit(None, gt=0)
    min_new_tokens: Int = 0
    num_beams: Int = limit(1, ge=1)
    generation_batch_size: Int = limit(8, gt=0)
    max_total_length: Int | None = None
    # Wall-clock limit for executing one SQL query (text-to-SQL execution match).
    sql_timeout_s: Float = limit(5.0, gt=0, allow_inf_nan=False, note="seconds")

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
    interval: Int = limit(1, gt=0)
    expert_interval: Int = limit(10, gt=0)
    telemetry_interval: Float = limit(10.0, gt=0, note="seconds")
    progress_bar: Bool = True
    report_to: list[Str] = Field(default_factory=list)


@dataclass(config=SECTION)
class MemoryConfig:
    gradient_checkpointing: Bool = False
    # With checkpointing on the CUDA fast path (LoRA, QLoRA): each layer's input waits in pinned host memory
    # until its backward, copied on a side stream (trainer/fastpath/offload.py).
    offload_checkpoints: Bool = True
    # Cross-entropy in checkpointed chunks of tokens, never the full fp32 logits (plain-head causal LMs).
    chunked_loss: Bool = True
    oom_fallback: Bool = True
    max_oom_retries: Int = limit(3, ge=0)


@dataclass(config=SECTION)
class FsdpConfig:
    """FSDP2 settings, read when training.distributed is fsdp (trainer/training/fsdp.py)."""

    # Free each layer's gathered weights after its forward (gathered again for backward): less memory,
    # one more all-gather per layer. false keeps them until backward (ZeRO-2-like).
    reshard_after_forward: Bool = True
    # Sharded parameters, gradients and optimizer state live in host memory; the optimizer steps on the CPU.
    cpu_offload: Bool = False
    # Recompute each decoder layer in backward, applied by FSDP around the wrapped layers (instead of
    # memory.gradient_checkpointing, which the model applies itself).
    activation_checkpointing: Bool = False
    # Every rank loads (QLoRA: quantizes) one tensor at a time and keeps only its own shard, so none holds the
    # whole model (trainer/model/sharded_loading.py): QLoRA, LoRA and full fine-tuning.
    cpu_ram_efficient_loading: Bool = False
    # The module classes that become one FSDP unit each; null: the model's decoder layer (_no_split_modules).
    wrap_classes: list[Str] | None = None


@dataclass(config=SECTION)
class PerformanceConfig:
    tf32: Bool = True
    # CUDA fast path for causal LMs (trainer/fastpath): auto takes it where it applies, on insists, off never.
    fast_path: Literal["auto", "on", "off"] = "auto"
    # Processes that tokenize and pack the data into its cache (once per data, tokenizer and settings);
    # 0: one per CPU core this process may use, at most 16.
    data_workers: Int = limit(0, ge=0)
    dataloader_num_workers: Int = limit(0, ge=0, note="the older name of data_workers, used when that is 0")
    pin_memory: Bool = False
    torch_threads: Int = 0


@dataclass(config=SECTION)
class NotifyConfig:
    webhook_url: Str | None = None
    email_config: Str | None = None
    events: list[Str] = Field(default_factory=lambda: ["start", "finish", "failure", "interrupt", "stall"])
    stall_minutes: Float = limit(30.0, gt=0)
    timeout_seconds: Float = 10.0


@dataclass(config=SECTION)
class Config:
    paths: PathsConfig = Field(default_factory=PathsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    performance: PerformanceConfig = Field(default_factory=PerformanceConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)

    @model_validator(mode="after")
    def _lora_methods_need_lora(self) -> Config:
        lo = self.lora
        if self.training.method == "full" and (lo.method != "lora" or lo.init == "lora_ga"):
            key = "method" if lo.method != "lora" else "init"
            value = lo.method if lo.method != "lora" else lo.init
            raise rule(
                f"{value} works on LoRA adapters, which training.method full has none of; "
                "use training.method lora or qlora",
                f"lora.{key}",
                "training.method",
            )
        return self

    @model_validator(mode="after")
    def _qlora_dtypes_agree(self) -> Config:
        t = self.training
        if t.method == "qlora" and t.mixed_precision == "fp16" and self.quantization.compute_dtype == "bf16":
            raise rule(
                "bf16 with training.mixed_precision fp16; use fp16 for both",
                "quantization.compute_dtype",
                "training.mixed_precision",
                "training.method",
            )
        return self

    @model_validator(mode="after")
    def _fsdp_combinations(self) -> Config:
        """What FSDP cannot run, refused before any model loads (docs/fsdp.md)."""
        if self.training.distributed != "fsdp":
            return self
        blame = "training.distributed"
        if self.model.family in ("gla", "mamba"):
            raise rule(
                f"the {self.model.family} family runs its own kernels, which FSDP does not shard yet; "
                "use training.distributed ddp",
                "model.family",
                blame,
            )
        if self.performance.fast_path == "on":
            raise rule(
                "the CUDA fast path reads whole weights, which FSDP keeps sharded; use auto or off",
                "performance.fast_path",
                blame,
            )
        if self.lora.init == "lora_ga" or self.lora.method == "sdlora":
            key, value = ("init", "lora_ga") if self.lora.init == "lora_ga" else ("method", "sdlora")
            raise rule(
                f"{value} prepares the adapters from whole base weights, not available with fsdp yet",
                f"lora.{key}",
                blame,
            )
        if self.optimization.optimizer != "adamw":
            raise rule(
                f"{self.optimization.optimizer}: bitsandbytes' optimizers cannot step FSDP's sharded (DTensor) "
                "parameters (bitsandbytes#1633); use adamw, whose state FSDP already divides among the GPUs",
                "optimization.optimizer",
                blame,
            )
        if self.training.mixed_precision == "fp16":
            raise rule(
                "fp16's loss scaling is not kept in FSDP checkpoints here; use bf16 (or no)",
                "training.mixed_precision",
                blame,
            )
        if self.fsdp.activation_checkpointing and self.memory.gradient_checkpointing:
            raise rule(
                "recomputes every decoder layer, as memory.gradient_checkpointing does; set only one of them",
                "fsdp.activation_checkpointing",
                "memory.gradient_checkpointing",
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {name: info.annotation for name, info in Config.__pydantic_fields__.items()}
CONFIG_ADAPTER = TypeAdapter(Config)
