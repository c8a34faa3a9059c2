"""Config overrides as a sweep file or the command line writes them, checked against the trainer's config.

``section.key: value`` (or the nested form), and the old launch scripts' environment names
(``NUM_WORKERS=4``) translated to the key they set, so a typo fails before any job starts.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import yaml

from trainer.sweep.jobs import SweepError

# Tuning knobs the old launch scripts read from the environment, and the config key each one sets.
# Both forms work in a sweep file (`env_tuning:`, `set:`, a dataset, a grid axis) and on the command
# line (`--tune NAME=VALUE`).
ENV_TUNING: dict[str, str] = {
    "NUM_WORKERS": "performance.dataloader_num_workers",
    "DATALOADER_NUM_WORKERS": "performance.dataloader_num_workers",
    "PIN_MEMORY": "performance.pin_memory",
    "DATALOADER_PIN_MEMORY": "performance.pin_memory",
    "OMP_NUM_THREADS": "performance.torch_threads",
    "TORCH_NUM_THREADS": "performance.torch_threads",
    "TF32": "performance.tf32",
    "ALLOW_TF32": "performance.tf32",
    "EVAL_BATCH_SIZE": "eval.batch_size",
    "PER_DEVICE_EVAL_BATCH_SIZE": "eval.batch_size",
    "EVAL_MAX_BATCHES": "eval.max_batches",
}
# Knobs of the old scripts' DataLoader/Trainer that have no counterpart in this loop: named so a sweep
# file that sets one fails clearly instead of silently doing nothing.
ENV_TUNING_MISSING: dict[str, str] = {
    "PREFETCH_FACTOR": "performance.prefetch_factor",
    "DATALOADER_PREFETCH_FACTOR": "performance.prefetch_factor",
    "PERSISTENT_WORKERS": "performance.persistent_workers",
    "DATALOADER_PERSISTENT_WORKERS": "performance.persistent_workers",
    "EVAL_ACCUMULATION_STEPS": "eval.accumulation_steps",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@functools.cache
def _config_hints() -> dict[str, dict[str, Any]]:
    """Section -> key -> type annotation, from the trainer's config models (Annotated extras dropped)."""
    from trainer.config import Config

    return {name: typing.get_type_hints(cls) for name, cls in typing.get_type_hints(Config).items()}


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing when none is close."""
    import difflib

    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _tuning_value(name: str, value: Any, key: str, where: str) -> Any:
    """An environment-style value ('4', '1', 'true') as the config key's type."""
    tp = _config_hints()[key.split(".")[0]][key.split(".")[1]]
    text = str(value).strip().lower()
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise SweepError(f"{where}: {name} expects 1/0 or true/false, got {value!r}")
    try:
        return int(str(value).strip())
    except ValueError:
        raise SweepError(f"{where}: {name} expects an integer, got {value!r}") from None


def normalize_key(key: Any, value: Any, where: str) -> tuple[str, Any]:
    """``section.key`` (checked against the trainer's config) or an old tuning name (translated)."""
    if not isinstance(key, str):
        raise SweepError(f"{where}: expected section.key or a tuning name, got {key!r}")
    if key in ENV_TUNING:
        return ENV_TUNING[key], _tuning_value(key, value, ENV_TUNING[key], where)
    if key in ENV_TUNING_MISSING:
        raise SweepError(
            f"{where}: {key} does not apply here (the trainer keeps tokenized rows in memory and collates them "
            "itself: no DataLoader workers to prefetch or keep alive, no evaluation outputs to accumulate); "
            f"tuning names that work: {', '.join(sorted(ENV_TUNING))}"
        )
    hints = _config_hints()
    section, _, name = key.partition(".")
    if not name:
        raise SweepError(
            f"{where}: {key!r} is neither section.key nor a tuning name{did_you_mean(key, ENV_TUNING)}"
        )
    if section not in hints or name not in hints[section]:
        from trainer.config import SECTIONS
        from trainer.config.errors import suggest_key, suggest_section

        if section not in hints:
            hint = suggest_section(section, SECTIONS)
            raise SweepError(f"{where}: unknown config section {section!r} in {key!r}{hint}")
        raise SweepError(f"{where}: unknown config key {key!r}{suggest_key(section, name, SECTIONS)}")
    tp = hints[section][name]
    if isinstance(value, str) and (tp is float or float in typing.get_args(tp)):
        try:
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    return key, value


def overrides_from(mapping: Any, where: str) -> dict[str, Any]:
    """A mapping of overrides: ``{lora.r: 8}``, ``{lora: {r: 8}}`` or ``{NUM_WORKERS: 4}``."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise SweepError(f"{where}: expected a mapping of section.key: value, got {mapping!r}")
    result: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and isinstance(key, str) and "." not in key:
            for sub_key, sub_value in value.items():  # the nested form, as in a config file
                k, v = normalize_key(f"{key}.{sub_key}", sub_value, where)
                result[k] = v
            continue
        k, v = normalize_key(key, value, where)
        result[k] = v
    return result


def parse_assignments(items: list[str], flag: str) -> dict[str, Any]:
    """``--set section.key=value`` / ``--tune NAME=VALUE`` from the command line."""
    result: dict[str, Any] = {}
    for text in items:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"{flag} {text!r}: expected KEY=VALUE")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if flag == "--tune" and key.strip() not in ENV_TUNING and key.strip() not in ENV_TUNING_MISSING:
            raise SweepError(
                f"--tune {text!r}: expected one of {', '.join(sorted(ENV_TUNING))} (or use --set)"
            )
        k, v = normalize_key(key.strip(), raw if flag == "--tune" else value, flag)
        result[k] = v
    return result
