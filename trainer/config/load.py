"""Loading a config: YAML (with ``file:line`` for every key) plus ``--set section.key=value`` overrides,
validated against the sections before any model loads, and the files it names checked.

Every mistake a user can make (unknown key, wrong type, bad value, missing file) becomes a
``ConfigError`` of one line per problem, naming where the value came from (``file:line`` or the
``--set`` argument); the CLI turns it into exit code 2. Finished runs' ``config.yaml`` is read through
the same models, tolerantly (``read_run_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainer.config.errors import ConfigError, KeyPath, Problem, describe, suggest_key
from trainer.config.sections import CONFIG_ADAPTER, SECTIONS, Config
from trainer.config.yaml_booleans import enum_booleans
from trainer.config.yamlfile import read_yaml


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
    raw = enum_booleans(raw, SECTIONS)
    try:
        return CONFIG_ADAPTER.validate_python(raw)
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
        if raw is None:  # a truncated or wrong file must not quietly become the embedded default run
            raise ConfigError(
                f"{path}: the config file is empty (expected sections such as paths:, model:, training:; "
                "leave --config out to train the embedded default)"
            )
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
        if key == "train_file" and config.data.dataset:
            continue  # data.dataset names the training data instead
        if value is not None:
            need(Path(value).expanduser().exists(), f"paths.{key}", f"file or folder not found: {value}")
    stage_one = config.lora.sdlora_stage_one_file
    if stage_one is not None and config.lora.method == "sdlora":
        need(Path(stage_one).is_file(), "lora.sdlora_stage_one_file", f"file not found: {stage_one}")
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
            return CONFIG_ADAPTER.validate_python(kept), ignored
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
