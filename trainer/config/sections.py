"""The config's sections as pydantic dataclasses: every key, its type, default, bounds and cross-key rules.

These types are the whole validation of values (``trainer.config.load`` reads the YAML, applies
``--set`` overrides and checks the files), and ``dataclasses.replace``/``asdict`` keep working on them.
A broken rule becomes a ``ConfigError`` line worded by trainer/config/errors.py. Each key's docstring
is its one-line description: docs/config-reference.md lists every key, generated from these classes by
``python -m trainer.config.reference`` (tests/config/test_reference.py fails when one lacks a docstring or
the page is stale). The sections of how a run goes about it (eval, logging, memory, fsdp, performance,
notify) are in ``run_sections``; what keys are made of (strict types, bounds, rules) in ``fields``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator
from pydantic.dataclasses import dataclass

from trainer.config.fields import SECTION, Bool, Float, Int, Str, limit, rule
from trainer.config.run_sections import (
    EvalConfig,
    FsdpConfig,
    LoggingConfig,
    MemoryConfig,
    NotifyConfig,
    PerformanceConfig,
)


@dataclass(config=SECTION)
class PathsConfig:
    """Where the run writes, what it trains on, where models download to."""

    output_dir: Str = "runs/default"
    """The run folder (logs, checkpoints, run.json: docs/run-folder.md); one holding a checkpoint is resumed."""
    train_file: Str = "data/tiny_corpus.jsonl"
    """Training data: a file (.jsonl, .json, .tsv, .csv, .parquet, .arrow) or a folder of them (docs/data.md);
    not read when data.dataset is set."""
    val_file: Str | None = None
    """Validation data, read like train_file (with data.dataset, data.val_split comes first); null:
    data.val_fraction of the training records."""
    cache_dir: Str | None = None
    """Where the model and tokenizer download to (transformers' cache_dir); null: Hugging Face's default
    (HF_HOME). The data cache is data.cache_dir."""


@dataclass(config=SECTION)
class ModelConfig:
    """The base model: where it comes from and how it loads (docs/families.md)."""

    name_or_path: Str = "configs/tiny-moe"
    """A Hugging Face Hub id, or a local folder with config.json (and the weights, unless random_init)."""
    family: Literal["auto", "causal", "gla", "mamba"] = "auto"
    """auto: picked from the checkpoint's model_type (its config.json); causal, gla or mamba forces one."""
    random_init: Bool = False
    """Build the model from its config.json with random weights instead of loading weights (the tiny examples)."""
    tokenizer: Str | None = None
    """Where the tokenizer is (a Hub id or a folder); null: name_or_path."""
    revision: Str | None = None
    """The Hub revision (branch, tag or commit) of the model and tokenizer; null: the default branch."""
    trust_remote_code: Bool = False
    """Let transformers run Python code that ships with the model's repository."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """The dtype the weights load in; auto: bf16 on a GPU that supports it, else fp32."""
    attn_implementation: Str | None = None
    """transformers' attention kernel (sdpa, eager, flex_attention, flash_attention_2); null: transformers'
    default, sdpa on the CUDA fast path (docs/data.md)."""
    kernel_path: Literal[
        "auto", "transformers", "fla-triton", "fla-naive-torch", "mamba_ssm", "fla-triton-ssd", "mambapy",
        "torch-reference",
    ] = "auto"  # fmt: skip
    """The implementation that runs the sequence mixing (trainer/model/kernel_choice.py): auto takes the best
    one that runs here and passes its start-up self-check; a name forces it (and a failed check stops the
    run). Each family has its own: causal transformers; GLA fla-triton, fla-naive-torch; Mamba mamba_ssm,
    fla-triton-ssd (Mamba-2), mambapy (Mamba-1), torch-reference."""


@dataclass(config=SECTION)
class DataConfig:
    """What the records are and how they become rows of tokens in the data cache (docs/data.md)."""

    format: Literal["auto", "text", "instruction", "chat"] = "auto"
    """auto: chat when the first record has messages_field (or ShareGPT's "conversations"), instruction when
    it has prompt_field and response_field, text otherwise."""
    text_field: Str = "text"
    """text records: the field holding the text (every token learned)."""
    prompt_field: Str = "prompt"
    """instruction records: the prompt's field (not learned)."""
    response_field: Str = "response"
    """instruction records: the response's field (learned)."""
    messages_field: Str = "messages"
    """chat records: a list of {"role", "content"} turns (ShareGPT's {"from", "value"} are mapped), rendered with
    the chat template; loss on the assistant turns only."""
    system_prompt: Str | None = None
    """chat: a system turn for conversations that have none."""
    chat_template: Str | None = None
    """chat: a Jinja template (the text, or a file) instead of the tokenizer's; null: the tokenizer's, else
    ChatML."""
    dataset: Str | None = None
    """A Hugging Face dataset instead of paths.train_file: a Hub id or a local folder load_dataset reads
    (offline once cached)."""
    dataset_config: Str | None = None
    """data.dataset's config name."""
    dataset_split: Str = "train"
    """data.dataset's split that trains."""
    dataset_revision: Str | None = None
    """data.dataset's revision (branch, tag or commit); null: the default branch."""
    val_split: Str | None = None
    """data.dataset's split that validates; null: paths.val_file, else val_fraction of the training split."""
    cache_dir: Str | None = None
    """Where tokenized, packed rows are cached (one folder per fingerprint); null: $FINETUNE_KIT_DATA_CACHE,
    else ~/.cache/finetune-kit/data. `python -m trainer cache list|clear` shows and removes them."""
    max_length: Int = limit(256, ge=8)
    """Tokens per row; a longer document is split or truncated (long_documents)."""
    packing: Bool = True
    """Pack several documents into each row of max_length tokens, kept apart by position ids that restart
    (where the family allows it: Mamba does not pack); false: one document a row."""
    long_documents: Literal["split", "truncate"] = "split"
    """A document longer than max_length: split into pieces (nothing lost) or truncate (the rest dropped)."""
    val_fraction: Float = limit(0.05, ge=0, lt=1)
    """Share of the records that validate when neither paths.val_file nor val_split is set (at least one
    record; 0: no validation)."""
    seed: Int = 42
    """Seed of the shuffle that picks the validation records."""
    on_bad_line: Literal["skip", "fail"] = "skip"
    """A malformed line or record: skip it (counted, the first five reported with file:line) or fail."""
    add_eos: Bool = True
    """text and instruction records end with the tokenizer's EOS token (chat ends as its template renders)."""


@dataclass(config=SECTION)
class TrainingConfig:
    """What trains, for how long, in what batches; checkpoints, resume and how the processes share the work."""

    method: Literal["qlora", "lora", "full"] = "lora"
    """qlora: LoRA adapters on a 4-bit base (the quantization section); lora: adapters on the base as loaded;
    full: every weight trains."""
    max_steps: Int = limit(0, ge=0, note="0 = use num_epochs")
    """Optimizer steps to train; 0: num_epochs decides."""
    num_epochs: Float = 1.0
    """Passes over the training rows (fractions allowed), used when max_steps is 0."""
    micro_batch_size: Int = limit(8, gt=0)
    """Rows per process in one forward and backward."""
    gradient_accumulation_steps: Int = limit(1, gt=0)
    """Micro-batches per optimizer step; the loss is normalised by the target tokens of all of them, across
    processes."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """accelerate's autocast: no, bf16, or fp16 (with loss scaling)."""
    seed: Int = 42
    """Seed of the weights' initialisation (random_init, adapters), dropout, and the order of rows in each
    epoch."""
    save_steps: Int = limit(50, gt=0)
    """A checkpoint every this many optimizer steps (and one at the end, and on SIGTERM/SIGINT)."""
    keep_top_k: Int = limit(2, ge=1)
    """Periodic checkpoints kept: the best keep_top_k by eval.metric_for_best, plus the latest."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint in paths.output_dir; never: start at step 0 even
    when one exists (--resume and --resume_from still resume)."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every process holds the whole model. fsdp: parameters, gradients and optimizer state are sharded
    across the processes (PyTorch FSDP2 through accelerate; the fsdp section; docs/fsdp.md)."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.max_steps == 0 and self.num_epochs <= 0:
            raise rule("expected > 0 when max_steps is 0", "num_epochs", "max_steps")
        return self


@dataclass(config=SECTION)
class OptimizationConfig:
    """The optimizer and the learning-rate schedule."""

    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = "adamw"
    """adamw: torch's AdamW (fused on CUDA); the others are bitsandbytes' AdamW with 8-bit or paged state (CUDA
    only)."""
    learning_rate: Float = limit(2e-4, gt=0)
    """The peak learning rate, reached at the end of warmup."""
    weight_decay: Float = limit(0.0, ge=0)
    """AdamW's decoupled weight decay, on weights of two or more dimensions (not biases and norms)."""
    adam_beta1: Float = 0.9
    """AdamW's beta1 (decay of the gradient's running mean)."""
    adam_beta2: Float = 0.999
    """AdamW's beta2 (decay of the squared gradient's running mean)."""
    adam_epsilon: Float = 1e-8
    """AdamW's epsilon, added to the denominator."""
    max_grad_norm: Float = limit(1.0, ge=0, note="0 disables")
    """Clip the gradient norm to this before each step; 0: no clipping."""
    lr_scheduler: Literal["constant", "linear", "cosine", "polynomial"] = "cosine"
    """After warmup: constant, linear decay to 0, cosine decay (to min_lr_ratio), or polynomial decay with
    polynomial_power (to min_lr_ratio)."""
    warmup_ratio: Float = limit(0.0, ge=0, lt=1)
    """Share of the total steps that warm the learning rate up linearly from 0 (when warmup_steps is 0)."""
    warmup_steps: Int = limit(0, ge=0)
    """Warmup steps; above 0 it replaces warmup_ratio."""
    polynomial_power: Float = 1.0
    """The polynomial schedule's power."""
    min_lr_ratio: Float = limit(0.0, ge=0, le=1)
    """The learning rate the cosine and polynomial schedules end at, as a fraction of learning_rate."""


LORA_INITS = ("default", "gaussian", "pissa", "olora", "loftq", "lora_ga")


@dataclass(config=SECTION)
class LoraConfig:
    """LoRA adapters (training.method lora and qlora), and the LoRA-GA and SDLoRA methods (docs/families.md)."""

    r: Int = limit(16, gt=0, what="a rank")
    """The adapters' rank."""
    alpha: Int = limit(32, gt=0)
    """Scale of the adapters' update: alpha / r (alpha / sqrt(r) with variant rslora)."""
    dropout: Float = limit(0.05, ge=0, lt=1)
    """Dropout on the adapters' input."""
    target_modules: list[Str] | Str | None = None
    """Modules that get adapters: a list of names, or one PEFT pattern (e.g. all-linear); null: the family's
    defaults."""
    target_parameters: list[Str] | None = None
    """Parameters that get LoRA directly (PEFT's target_parameters): MoE models' fused 3-D expert weights."""
    variant: Literal["lora", "dora", "rslora"] = "lora"
    """lora, dora (weight-decomposed) or rslora (rank-stabilised scale)."""
    init: Str = "default"
    """How adapters start: default, gaussian, pissa, pissa_niter_N, olora, loftq, or lora_ga (LoRA-GA)."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train: none, all, or those of the adapted modules (lora_only)."""
    method: Literal["lora", "sdlora"] = "lora"
    """lora: adapters only. sdlora (Mamba): adapters plus a selected few SSM channels/states."""
    lora_ga_batches: Int = limit(8, gt=0)
    """LoRA-GA: micro-batches of training data whose accumulated gradient is factorised."""
    lora_ga_gamma: Float = limit(16.0, gt=0)
    """LoRA-GA: the paper's stable-scale gamma."""
    sdlora_channels: Float = limit(0.01, gt=0, le=1, what="a fraction")
    """SDLoRA: the fraction of each layer's SSM channels that train in stage two."""
    sdlora_states: Float = limit(0.05, gt=0, le=1, what="a fraction")
    """SDLoRA: the fraction of states, per selected channel, that train in stage two."""
    sdlora_stage_one_steps: Int = limit(20, gt=0)
    """SDLoRA: optimizer steps of stage one, which picks the channels and states."""
    sdlora_stage_one_file: Str | None = None
    """SDLoRA: stage one's data, read like paths.train_file; null: the training rows."""
    sdlora_params: list[Literal["A_log", "BC", "D", "dt", "conv"]] | None = None
    """SDLoRA: the SSM tensors whose selected entries train; null: the model type's default (Mamba-1 A_log,
    BC; Mamba-2 A_log, D, dt, conv)."""

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
    """The 4-bit base of training.method qlora (bitsandbytes)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type: nf4 (NormalFloat) or fp4."""
    double_quant: Bool = True
    """Quantize the quantization constants too (bitsandbytes' double quantization)."""
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """The dtype 4-bit weights are dequantized to for their matmuls."""
    skip_modules: list[Str] = Field(default_factory=lambda: ["lm_head"])
    """Modules that stay unquantized, besides the family's own."""
    quantize_experts: Bool = True
    """Fused 3-D MoE expert weights escape bitsandbytes' Linear replacement; quantize them too."""
    upcast: Literal["auto", "on", "off"] = "auto"
    """The parameters left in 16 bits (norms, embeddings, head) in fp32, as peft's prepare_model_for_kbit_training
    does. auto: on the reference paths; the CUDA fast path, GLA's and Mamba's GPU kernels and FSDP keep them
    16-bit. off: 16-bit everywhere (the reference path then trains in the fast path's precision). on: always;
    needs performance.fast_path off and DDP."""


@dataclass(config=SECTION)
class Config:
    """The whole config: one section each (the sections' docstrings describe them)."""

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
    def _upcast_where_it_can_run(self) -> Config:
        """quantization.upcast on: FSDP would cast the fp32 copies back when it gathers them, and the fast
        path's kernels take the 16-bit weights."""
        if self.quantization.upcast != "on" or self.training.method != "qlora":
            return self
        if self.training.distributed == "fsdp":
            raise rule(
                "on: FSDP casts every weight it gathers to bf16; use auto or off",
                "quantization.upcast",
                "training.distributed",
            )
        if self.performance.fast_path != "off":
            raise rule(
                "on upcasts for the reference path; set performance.fast_path: off too, or use auto",
                "quantization.upcast",
                "performance.fast_path",
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

    def grads_synced_after_step(self, processes: int) -> bool:
        """Whether several processes keep their gradients local through each step and average them once after
        it (trainer/training/oom_retry.py ``agree_and_sync``), rather than through DDP's gradient hooks during
        backward: LoRA-style methods with memory.oom_fallback on, under DDP. Full fine-tuning keeps DDP's
        all-reduce overlapping backward; FSDP reduce-scatters into shards during backward."""
        return (
            processes > 1
            and self.memory.oom_fallback
            and self.training.method != "full"
            and self.training.distributed != "fsdp"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {name: info.annotation for name, info in Config.__pydantic_fields__.items()}
CONFIG_ADAPTER = TypeAdapter(Config)
