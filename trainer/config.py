"""Typed configuration: YAML + ``--set section.key=value`` overrides, validated before any model loads.

Every mistake a user can make in the YAML (unknown key, wrong type, bad value, missing file)
becomes a ``ConfigError`` with a one-line message; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config problem, phrased for the user in one line."""


@dataclass
class PathsConfig:
    output_dir: str = "runs/default"
    train_file: str = "data/tiny_corpus.jsonl"
    val_file: str | None = None
    cache_dir: str | None = None


@dataclass
class ModelConfig:
    name_or_path: str = "configs/tiny-moe"
    family: Literal["auto", "causal", "gla", "mamba"] = "auto"
    random_init: bool = False
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    attn_implementation: str | None = None


@dataclass
class DataConfig:
    format: Literal["auto", "text", "instruction"] = "auto"
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    max_length: int = 256
    packing: bool = True
    long_documents: Literal["split", "truncate"] = "split"
    val_fraction: float = 0.05
    seed: int = 42
    on_bad_line: Literal["skip", "fail"] = "skip"
    add_eos: bool = True


@dataclass
class TrainingConfig:
    method: Literal["qlora", "lora", "full"] = "lora"
    max_steps: int = 0
    num_epochs: float = 1.0
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    seed: int = 42
    save_steps: int = 50
    keep_top_k: int = 2
    resume: Literal["auto", "never"] = "auto"


@dataclass
class OptimizationConfig:
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"] = "adamw"
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler: Literal["constant", "linear", "cosine", "polynomial"] = "cosine"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    polynomial_power: float = 1.0
    min_lr_ratio: float = 0.0


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str | None = None
    target_parameters: list[str] | None = None
    variant: Literal["lora", "dora", "rslora"] = "lora"
    init: str = "default"
    bias: Literal["none", "all", "lora_only"] = "none"


@dataclass
class QuantizationConfig:
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])
    # Fused 3-D MoE expert weights escape bitsandbytes' Linear replacement; quantize them too.
    quantize_experts: bool = True


@dataclass
class EvalConfig:
    interval: int = 50
    batch_size: int = 8
    max_batches: int = 0
    at_start: bool = False
    at_end: bool = True
    # auto: the task's official metric when eval.task is set, else eval_loss. greater_is_better unset
    # (null) follows the metric: lower for losses, higher otherwise.
    metric_for_best: str = "auto"
    greater_is_better: bool | None = None
    # Generation-based evaluation on a task (trainer/tasks): glue names, or spider.
    task: str | None = None
    task_data_dir: str | None = None
    task_split: str = "validation"
    task_max_examples: int = 0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    num_beams: int = 1
    generation_batch_size: int = 8
    max_total_length: int | None = None
    # Seconds one predicted (or gold) SQL query may run before it is stopped and counted as a timeout.
    sql_timeout_s: float = 5.0


@dataclass
class LoggingConfig:
    interval: int = 1
    expert_interval: int = 10
    telemetry_interval: float = 10.0
    progress_bar: bool = True
    report_to: list[str] = field(default_factory=list)


@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = False
    # Cross-entropy in checkpointed chunks of tokens, never the full fp32 logits (plain-head causal LMs).
    chunked_loss: bool = True
    oom_fallback: bool = True
    max_oom_retries: int = 3


@dataclass
class PerformanceConfig:
    tf32: bool = True
    # CUDA fast path for causal LMs (trainer/fastpath): auto takes it where it applies, on insists, off never.
    fast_path: Literal["auto", "on", "off"] = "auto"
    dataloader_num_workers: int = 0  # threads that tokenize the data at start-up (rows then stay in memory)
    pin_memory: bool = False
    torch_threads: int = 0


@dataclass
class NotifyConfig:
    webhook_url: str | None = None
    email_config: str | None = None
    events: list[str] = field(default_factory=lambda: ["start", "finish", "failure", "interrupt", "stall"])
    stall_minutes: float = 30.0
    timeout_seconds: float = 10.0


@dataclass
class Config:
    paths: PathsConfig = field(default_factory=PathsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _nearest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid: {', '.join(sorted(choices))})"


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation; ints are accepted for floats, nothing else is guessed."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        return [_coerce(v, get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            value = _yaml_number(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def _yaml_number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _section_hints(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def build_config(raw: dict, source: str = "config") -> Config:
    """Build a typed Config from a nested dict, naming the first bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    sections = {}
    for section_name, values in raw.items():
        if section_name not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section '{section_name}'{_nearest(section_name, list(SECTIONS))}"
            )
        section_cls = typing.get_type_hints(Config)[section_name]
        hints = _section_hints(section_cls)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section_name}' must be a mapping, got {values!r}")
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{source}: unknown key '{section_name}.{key}'{_nearest(key, list(hints))}")
            kwargs[key] = _coerce(value, hints[key], f"{source}: {section_name}.{key}")
        sections[section_name] = section_cls(**kwargs)
    return Config(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` with the value read as YAML (so 1e-4, true, [a, b] work)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, value_text = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc.problem})") from exc
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or the built-in defaults when path is None), apply overrides, validate."""
    raw: dict = {}
    source = str(path) if path else "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"--set {text}: unknown section '{section}'{_nearest(section, list(SECTIONS))}")
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][key] = value
    config = build_config(raw, source)
    validate(config)
    return config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Values that type-check but make no sense, and files that must exist, before loading a model."""
    t, o, lo, e, d = config.training, config.optimization, config.lora, config.eval, config.data
    _require(o.learning_rate > 0, f"optimization.learning_rate: expected > 0, got {o.learning_rate}")
    _require(o.weight_decay >= 0, f"optimization.weight_decay: expected >= 0, got {o.weight_decay}")
    _require(
        o.max_grad_norm >= 0, f"optimization.max_grad_norm: expected >= 0 (0 disables), got {o.max_grad_norm}"
    )
    _require(0 <= o.warmup_ratio < 1, f"optimization.warmup_ratio: expected in [0, 1), got {o.warmup_ratio}")
    _require(o.warmup_steps >= 0, f"optimization.warmup_steps: expected >= 0, got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, f"optimization.min_lr_ratio: expected in [0, 1], got {o.min_lr_ratio}")
    _require(lo.r > 0, f"lora.r: expected a rank > 0, got {lo.r}")
    _require(lo.alpha > 0, f"lora.alpha: expected > 0, got {lo.alpha}")
    _require(0 <= lo.dropout < 1, f"lora.dropout: expected in [0, 1), got {lo.dropout}")
    _require(t.micro_batch_size > 0, f"training.micro_batch_size: expected > 0, got {t.micro_batch_size}")
    _require(
        t.gradient_accumulation_steps > 0,
        f"training.gradient_accumulation_steps: expected > 0, got {t.gradient_accumulation_steps}",
    )
    _require(t.max_steps >= 0, f"training.max_steps: expected >= 0 (0 = use num_epochs), got {t.max_steps}")
    _require(t.max_steps > 0 or t.num_epochs > 0, "training.num_epochs: expected > 0 when max_steps is 0")
    _require(t.save_steps > 0, f"training.save_steps: expected > 0, got {t.save_steps}")
    _require(t.keep_top_k >= 1, f"training.keep_top_k: expected >= 1, got {t.keep_top_k}")
    _require(e.interval > 0, f"eval.interval: expected > 0, got {e.interval}")
    _require(e.batch_size > 0, f"eval.batch_size: expected > 0, got {e.batch_size}")
    _require(config.logging.interval > 0, f"logging.interval: expected > 0, got {config.logging.interval}")
    _require(config.logging.expert_interval > 0, "logging.expert_interval: expected > 0")
    _require(config.logging.telemetry_interval > 0, "logging.telemetry_interval: expected > 0 seconds")
    _require(d.max_length >= 8, f"data.max_length: expected >= 8, got {d.max_length}")
    _require(0 <= d.val_fraction < 1, f"data.val_fraction: expected in [0, 1), got {d.val_fraction}")
    _require(config.memory.max_oom_retries >= 0, "memory.max_oom_retries: expected >= 0")
    _require(e.num_beams >= 1, f"eval.num_beams: expected >= 1, got {e.num_beams}")
    _require(e.max_new_tokens is None or e.max_new_tokens > 0, "eval.max_new_tokens: expected > 0")
    _require(e.generation_batch_size > 0, "eval.generation_batch_size: expected > 0")
    _require(
        0 < e.sql_timeout_s < float("inf"),
        f"eval.sql_timeout_s: expected a finite number of seconds > 0, got {e.sql_timeout_s}",
    )
    _require(config.notify.stall_minutes > 0, "notify.stall_minutes: expected > 0")
    if e.task is not None:
        from trainer.tasks import TASK_NAMES

        _require(
            e.task.lower().replace("-", "") in TASK_NAMES,
            f"eval.task: expected one of {', '.join(TASK_NAMES)}, got {e.task!r}",
        )
        _require(
            e.task_data_dir is not None or e.task != "spider",
            "eval.task_data_dir: spider needs a folder with tables.json, database/ and the question files",
        )
        if e.task_data_dir is not None:
            _require(
                Path(e.task_data_dir).is_dir(), f"eval.task_data_dir: folder not found: {e.task_data_dir}"
            )
    if config.notify.email_config is not None:
        _require(
            Path(config.notify.email_config).expanduser().is_file(),
            f"notify.email_config: file not found: {config.notify.email_config}",
        )
    _require(
        lo.init == "default"
        or lo.init in ("gaussian", "pissa", "olora", "loftq")
        or lo.init.startswith("pissa_niter_"),
        f"lora.init: expected default, gaussian, pissa or pissa_niter_N, got {lo.init!r}",
    )
    _require(
        Path(config.paths.train_file).is_file(),
        f"paths.train_file: file not found: {config.paths.train_file}",
    )
    if config.paths.val_file is not None:
        _require(
            Path(config.paths.val_file).is_file(), f"paths.val_file: file not found: {config.paths.val_file}"
        )
    if t.method == "qlora" and t.mixed_precision == "fp16" and config.quantization.compute_dtype == "bf16":
        raise ConfigError(
            "quantization.compute_dtype: bf16 with training.mixed_precision fp16; use fp16 for both"
        )
    model_path = Path(config.model.name_or_path)
    looks_local = config.model.name_or_path.startswith((".", "/", "~")) or model_path.exists()
    if looks_local:
        _require(model_path.is_dir(), f"model.name_or_path: folder not found: {config.model.name_or_path}")
        _require(
            (model_path / "config.json").is_file(),
            f"model.name_or_path: {model_path / 'config.json'} is missing (expected a transformers model folder)",
        )


def dump_config(config: Config, path: Path) -> None:
    """The resolved config, exactly as used, so ``--config <run>/config.yaml`` reproduces the run."""
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
