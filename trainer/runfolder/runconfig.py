"""A run's saved config.yaml as flat ``section.key`` values: the config panel, the config diff and the
hyperparameter columns of the runs overview.

Read with pyyaml (a base dependency) and nothing of ``trainer.config``, so readers stay free of the
training stack; a config written by an older or newer trainer still reads, key by key. Parsed
configs are kept by (path, mtime, size): the overview asks for every run's on each request.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from trainer.runfolder.layout import CONFIG_YAML
from trainer.runfolder.reader import inside

MAX_BYTES = 1 << 20
_cache: OrderedDict[tuple, dict] = OrderedDict()
_lock = threading.Lock()


def flatten(value, prefix: str = "") -> dict:
    """``{"lora": {"r": 16}}`` -> ``{"lora.r": 16}``; lists stay values."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    flat: dict = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            flat.update(flatten(item, name))
        else:
            flat[name] = item
    return flat


def read_config(run_dir: Path, root: Path | None = None) -> dict:
    """The run's config.yaml as flat keys; {} when missing, unreadable, outside ``root`` or not a mapping."""
    import yaml  # here: only readers of configs pay for it

    path = Path(run_dir) / CONFIG_YAML
    if not inside(path, root):
        return {}
    try:
        st = os.stat(path)
    except OSError:
        return {}
    key = (str(path), st.st_mtime_ns, st.st_size)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    try:
        with open(path, "rb") as handle:
            loaded = yaml.safe_load(handle.read(MAX_BYTES))
    except (OSError, yaml.YAMLError, ValueError):
        loaded = None
    flat = flatten(loaded) if isinstance(loaded, dict) else {}
    with _lock:
        _cache[key] = flat
        while len(_cache) > 512:
            _cache.popitem(last=False)
    return flat


def _number(value) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def hyperparameters(flat: dict, run_json: dict) -> dict:
    """The few settings people compare runs by, from the saved config (run.json where it knows better)."""
    method = run_json.get("method") or flat.get("training.method")
    micro = _number(flat.get("training.micro_batch_size"))
    accumulation = _number(flat.get("training.gradient_accumulation_steps")) or 1
    world = _number(run_json.get("world_size")) or 1
    return {
        "method": method if isinstance(method, str) else None,
        "model": run_json.get("model") or flat.get("model.name_or_path"),
        "lora_r": _number(flat.get("lora.r")) if method in ("lora", "qlora", None) else None,
        "learning_rate": _number(flat.get("optimization.learning_rate")),
        "effective_batch": int(micro * accumulation * world) if micro else None,
    }


def differing(configs: list[dict]) -> list[str]:
    """Keys whose value is not the same in every config (absent counts as a value), sorted."""
    keys = sorted(set().union(*configs)) if configs else []
    missing = object()
    return [k for k in keys if len({repr(c.get(k, missing)) for c in configs}) > 1]
