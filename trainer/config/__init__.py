"""Typed configuration, validated before any model loads: ``from trainer.config import Config, load_config``.

- ``sections``: one pydantic dataclass per section (paths, model, data, training, optimization, lora,
  quantization, eval, logging, memory, fsdp, performance, notify): keys, types, defaults, bounds, rules,
  and each key's docstring.
- ``load``: YAML plus ``--set section.key=value`` overrides, files checked, a run's ``config.yaml`` read back.
- ``errors``: pydantic's errors as one line per problem, with the nearest valid key ("did you mean").
- ``yamlfile``: YAML with the line of every key, shared with the sweep file.
- ``reference``: docs/config-reference.md, every key, generated from ``sections`` (``python -m
  trainer.config.reference``).

Everything a caller needs is importable from here; docs/config-reference.md lists every key.
"""

from trainer.config.errors import ConfigError
from trainer.config.load import (
    build_config,
    dump_config,
    load_config,
    missing_files,
    parse_override,
    read_run_config,
    validate,
)
from trainer.config.sections import (
    LORA_INITS,
    SECTIONS,
    Config,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    NotifyConfig,
    OptimizationConfig,
    PathsConfig,
    PerformanceConfig,
    QuantizationConfig,
    TrainingConfig,
)

__all__ = [
    "LORA_INITS",
    "SECTIONS",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "NotifyConfig",
    "OptimizationConfig",
    "PathsConfig",
    "PerformanceConfig",
    "QuantizationConfig",
    "TrainingConfig",
    "build_config",
    "dump_config",
    "load_config",
    "missing_files",
    "parse_override",
    "read_run_config",
    "validate",
]
