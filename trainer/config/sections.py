"""Typed configuration: YAML + ``--set section.key=value`` overrides, validated before any model loads.

Each section is a pydantic dataclass: the types, bounds and cross-key rules below are the whole
validation of values (``missing_files`` checks the files), and ``dataclasses.replace``/``asdict`` keep
working on them. Every mistake a user can make (unknown key, wrong type, bad value, missing file)
becomes a ``ConfigError`` of one line per problem, naming where the value came from (``file:line`` or
the ``--set`` argument); the CLI turns it into exit code 2. The wording lives in
trainer/config_errors.py; docs/config.md has the rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from trainer.config_errors import ConfigError, KeyPath, Problem, describe, suggest_key
from trainer.yamlfile import read_yaml


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


@dataclass(config=SECTION)
class DataConfig:
    format: Literal["auto", "text", "instruction"] = "auto"
    text_field: Str = "text"
    prompt_field: Str = "prompt"
    response_field: Str = "response"
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


LORA_INITS = ("default", "gaussian", "pissa", "olora", "loftq")


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

    @field_validator("init")
    @classmethod
    def _known_init(cls, value: str) -> str:
        if value not in LORA_INITS and not value.startswith("pissa_niter_"):
            raise rule(f"expected default, gaussian, pissa or pissa_niter_N, got {value!r}")
        return value


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
    # Cross-entropy in checkpointed chunks of tokens, never the full fp32 logits (plain-head causal LMs).
    chunked_loss: Bool = True
    oom_fallback: Bool = True
    max_oom_retries: Int = limit(3, ge=0)


@dataclass(config=SECTION)
class PerformanceConfig:
    tf32: Bool = True
    # CUDA fast path for causal LMs (trainer/fastpath): auto takes it where it applies, on insists, off never.
    fast_path: Literal["auto", "on", "off"] = "auto"
    dataloader_num_workers: Int = 0  # threads that tokenize the data at start-up (rows then stay in memory)
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
    performance: PerformanceConfig = Field(default_factory=PerformanceConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {name: info.annotation for name, info in Config.__pydantic_fields__.items()}
_ADAPTER = TypeAdapter(Config)


def _str_keys(values: Any) -> Any:
    """YAML reads ``1:`` as an integer key; as a config key it is just an unknown name."""
    return {str(k): v for k, v in values.items()} if isinstance(values, dict) else values


def _build(raw: Any, where) -> Config:
    """Validate a nested dict; ``where(key_path)`` names the source of a value (or None)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where(())}: expected a mapping of sections at the top level")
    raw = {str(section): _str_keys({} if values is None else values) for section, values in raw.items()}
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise ConfigError.of(describe(exc, raw, SECTIONS), where) from None


def build_config(raw: dict, source: str = "config") -> Config:
    """Build a typed Config from a nested dict (types and values; files are not checked)."""
    return _build(raw, lambda key: source)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` with the value read as YAML (so 1e-4, true, [a, b] work)."""
    dotted, sep, value_text = text.partition("=")
    if not sep or "." not in dotted:
        name = dotted.strip()
        hint = suggest_key(None, name, SECTIONS) if sep and name and name not in SECTIONS else ""
        raise ConfigError(f"--set {text!r}: expected section.key=value{hint}")
    section, key = dotted.strip().split(".", 1)
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc.problem})") from exc
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or the built-in defaults when path is None), apply overrides, validate."""
    raw: Any = {}
    origins: dict[KeyPath, str] = {}
    if path is not None:
        raw, lines = read_yaml(path, ConfigError, what="config file")
        origins = {key: f"{path}:{line}" for key, line in lines.items()}
        origins[()] = str(path)
        raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for text in overrides:
        section, key, value = parse_override(text)
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][key] = value
        origins[(section, key)] = f"--set {text}"
        origins.setdefault((section,), f"--set {text}")

    def where(key: KeyPath) -> str | None:
        return origins.get(key[:2])  # a key left at its default has no source

    config = _build(raw, where)
    problems = missing_files(config)
    if problems:
        raise ConfigError.of(problems, where)
    return config


def missing_files(config: Config) -> list[Problem]:
    """Files and folders the config names that must exist before a model is loaded."""
    problems: list[Problem] = []

    def need(ok: bool, key: str, message: str) -> bool:
        if not ok:
            problems.append(Problem((tuple(key.split(".")),), f"{key}: {message}"))
        return ok

    e = config.eval
    if e.task is not None and e.task_data_dir is not None:
        need(Path(e.task_data_dir).is_dir(), "eval.task_data_dir", f"folder not found: {e.task_data_dir}")
    email = config.notify.email_config
    if email is not None:
        need(Path(email).expanduser().is_file(), "notify.email_config", f"file not found: {email}")
    for key in ("train_file", "val_file"):
        value = getattr(config.paths, key)
        if value is not None:
            need(Path(value).is_file(), f"paths.{key}", f"file not found: {value}")
    name = config.model.name_or_path
    model_path = Path(name)
    if name.startswith((".", "/", "~")) or model_path.exists():
        if need(model_path.is_dir(), "model.name_or_path", f"folder not found: {name}"):
            need(
                (model_path / "config.json").is_file(),
                "model.name_or_path",
                f"{model_path / 'config.json'} is missing (expected a transformers model folder)",
            )
    return problems


def validate(config: Config) -> None:
    """Raise ConfigError when a file or folder the config names is missing (values are checked on build)."""
    problems = missing_files(config)
    if problems:
        raise ConfigError.of(problems, lambda key: None)


def read_run_config(path: str | Path) -> tuple[Config | None, list[str]]:
    """A run folder's ``config.yaml`` through the same models, for tools that read finished runs.

    Tolerant of runs written by other versions: a section or key the models no longer know, and a
    value they now refuse, is left out (its default applies) and named in the returned list.
    Files are not checked (the data may have moved). None when the file is missing or not a mapping.
    """
    try:
        raw, _ = read_yaml(path, ConfigError)
    except ConfigError:
        return None, []
    if not isinstance(raw, dict):
        return None, []
    kept: dict[str, dict] = {}
    ignored: list[str] = []
    for section, values in raw.items():
        cls = SECTIONS.get(section)
        if cls is None or not isinstance(values, (dict, type(None))):
            ignored.append(str(section))
            continue
        known = cls.__pydantic_fields__
        kept[section] = {k: v for k, v in (values or {}).items() if k in known}
        ignored += [f"{section}.{k}" for k in values or {} if k not in known]
    while True:
        try:
            return _ADAPTER.validate_python(kept), ignored
        except ValidationError as exc:
            dropped = False
            for problem in describe(exc, kept, SECTIONS):
                for section, key in (p for p in problem.keys if len(p) == 2):
                    if key in kept.get(section, {}):
                        del kept[section][key]
                        ignored.append(f"{section}.{key}")
                        dropped = True
                        break
            if not dropped:
                return None, ignored


def dump_config(config: Config, path: Path) -> None:
    """The resolved config, exactly as used, so ``--config <run>/config.yaml`` reproduces the run."""
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
