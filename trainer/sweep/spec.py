"""The sweep file, expanded into jobs: base configs × datasets × override grid × seeds.

Every job gets a readable name built from what makes it different (``glue-lora_sst2_r8_seed1``),
the same every time the file is read, and its own folder ``<root>/<name>``. Relative paths are
read from the working directory, as the trainer's own config does. docs/sweeps.md has the format.

Over 400 lines on purpose: every field of the sweep file is checked here, each with its own
``file:line`` message, and job naming depends on those same checked values.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import itertools
import json
import re
import shlex
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TOP_LEVEL_KEYS = (
    "name",
    "output_root",
    "configs",
    "datasets",
    "grid",
    "seeds",
    "set",
    "env_tuning",
    "names",
    "retries",
    "gpus",
    "gpu_plan",
    "command",
    "backend",
    "slurm",
)
BACKENDS = ("local", "slurm")
SEED_KEY = "training.seed"
MAX_NAME = 120

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


class SweepError(ValueError):
    """A problem with the sweep file or the command line, phrased for the user in one line."""


@dataclass(frozen=True)
class Job:
    """One training run of the sweep."""

    name: str
    config: str  # absolute path of the base config
    config_name: str
    dataset: str | None
    seed: Any
    experiment: str  # the name without dataset and seed: what seeds are averaged over
    params: dict[str, Any]  # the grid values that make this job differ
    overrides: dict[str, Any]  # every `--set` it gets, in the order they apply
    output_dir: Path
    index: int = 0  # place in the whole sweep (before --only): a SLURM array task's index

    @property
    def log_path(self) -> Path:
        return self.output_dir / "job.log"


@dataclass
class Sweep:
    name: str
    file: Path
    root: Path
    jobs: list[Job]
    retries: int = 1
    command: list[str] | None = None  # None: python -m trainer train
    gpus: list[str] | None = None
    gpu_plan: list[int] | None = None
    cwd: Path = field(default_factory=Path.cwd)
    backend: str = "local"  # local: GPU slots on this machine; slurm: one SLURM job array
    slurm: dict | None = None  # the file's slurm: section, read by trainer.sweep.slurm


# ---------------------------------------------------------------- values and keys


def render_value(value: Any) -> str:
    """A value as ``--set`` reads it back (YAML): plain where unambiguous, else JSON (valid YAML)."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_/.~][\w./~+-]*", value):
        if yaml.safe_load(value) == value:
            return value
    return json.dumps(value)


@functools.cache
def _config_hints() -> dict[str, dict[str, Any]]:
    """Section -> key -> type annotation, from the trainer's config models (Annotated extras dropped)."""
    from trainer.config import Config

    return {name: typing.get_type_hints(cls) for name, cls in typing.get_type_hints(Config).items()}


def _nearest(name: str, choices) -> str:
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
            f"{where}: {key!r} is neither section.key nor a tuning name{_nearest(key, ENV_TUNING)}"
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


# ---------------------------------------------------------------- names


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-.") or "x"


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, (list, tuple)):
        return "+".join(_value_text(v) for v in value)
    if value is None:
        return "none"
    return str(value)


def name_part(label: str, value: Any) -> str:
    """``r8``, ``seed1``, ``variant-dora``: a number joins its label, a word gets a dash."""
    text = _value_text(value)
    if not label:
        return _clean(text)
    joined = label + text if re.match(r"[0-9]", text) and label[-1].isalpha() else f"{label}-{text}"
    return _clean(joined)


def axis_labels(keys: list[str], custom: dict[str, str]) -> dict[str, str]:
    """Each grid key's label in job names: the last part of the key, the whole key where two clash."""
    short = {k: k.rsplit(".", 1)[-1].lower() for k in keys}
    counts: dict[str, int] = {}
    for label in short.values():
        counts[label] = counts.get(label, 0) + 1
    labels = {k: (short[k] if counts[short[k]] == 1 else k.replace(".", "-")) for k in keys}
    labels.update({k: v for k, v in custom.items() if k in labels})
    return labels


def fit_name(name: str) -> str:
    """Keep folder names short enough; a long one keeps its start and gets a hash of the whole."""
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9].rstrip('_-.')}-{digest}"


# ---------------------------------------------------------------- the file


def _path(text: Any, where: str) -> Path:
    if not isinstance(text, str) or not text.strip():
        raise SweepError(f"{where}: expected a file path, got {text!r}")
    return Path(text).expanduser().resolve()


def _configs(raw: Any) -> list[tuple[str, Path, dict[str, Any]]]:
    """``configs``: one path, a list of paths (named by file stem) or a mapping name -> path."""
    if isinstance(raw, str):
        raw = [raw]
    entries: list[tuple[str, Path, dict[str, Any]]] = []
    if isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            path = _path(item, f"configs[{i}]")
            entries.append((_clean(path.stem), path, {}))
    elif isinstance(raw, dict) and raw:
        for name, item in raw.items():
            where = f"configs.{name}"
            if isinstance(item, dict):
                unknown = set(item) - {"path", "set"}
                if unknown:
                    raise SweepError(f"{where}: unknown keys {sorted(unknown)} (expected path and set)")
                entries.append((_clean(str(name)), _path(item.get("path"), f"{where}.path"),
                                overrides_from(item.get("set"), f"{where}.set")))  # fmt: skip
            else:
                entries.append((_clean(str(name)), _path(item, where), {}))
    else:
        raise SweepError("configs: expected a config path, a list of paths or a mapping name: path")
    names = [e[0] for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SweepError(f"configs: two configs are named {dupes[0]!r}; give them names (name: path)")
    for name, path, _ in entries:
        if not path.is_file():
            raise SweepError(f"configs.{name}: file not found: {path}")
    return entries


def _datasets(raw: Any) -> list[tuple[str | None, dict[str, Any]]]:
    if raw is None:
        return [(None, {})]
    if not isinstance(raw, dict) or not raw:
        raise SweepError("datasets: expected a mapping name: {section.key: value, ...}")
    return [(_clean(str(name)), overrides_from(values, f"datasets.{name}")) for name, values in raw.items()]


def _grid(raw: Any) -> list[tuple[str, list[Any], str]]:
    """Axes as (config key, values, the key as written: it labels the job names)."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise SweepError("grid: expected a mapping section.key: [values]")
    axes: list[tuple[str, list[Any], str]] = []
    for key, values in raw.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid.{key}: expected a non-empty list of values, got {values!r}")
        converted = [normalize_key(key, v, f"grid.{key}") for v in values]
        axes.append((converted[0][0], [v for _, v in converted], str(key)))
    keys = [k for k, _, _ in axes]
    if len(set(keys)) != len(keys):
        raise SweepError("grid: two axes set the same config key")
    return axes


def _int(raw: Any, where: str, default: int, low: int = 0) -> int:
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
        raise SweepError(f"{where}: expected an integer >= {low}, got {raw!r}")
    return raw


def read_sweep_file(path: Path) -> dict:
    from trainer.config.yamlfile import read_yaml

    raw, lines = read_yaml(path, SweepError, what="sweep file")
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: expected a mapping (configs, grid, seeds, ...) at the top level")
    unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
    if unknown:
        line = lines.get((str(unknown[0]),))
        raise SweepError(
            f"{path}{f':{line}' if line else ''}: unknown key {unknown[0]!r}"
            f"{_nearest(str(unknown[0]), TOP_LEVEL_KEYS)}; "
            f"expected {', '.join(TOP_LEVEL_KEYS)}"
        )
    if "configs" not in raw:
        raise SweepError(f"{path}: 'configs' is missing (the base config file(s) every job starts from)")
    return raw


def load_sweep(
    path: str | Path,
    root: str | Path | None = None,
    cli_set: list[str] = (),
    cli_tune: list[str] = (),
    only: list[str] = (),
    validate: bool = True,
) -> Sweep:
    """Read and expand a sweep file; every mistake is a ``SweepError`` before anything starts."""
    path = Path(path)
    raw = read_sweep_file(path)
    name = _clean(str(raw.get("name") or path.stem))
    root_path = Path(root or raw.get("output_root") or Path("runs") / name).expanduser().resolve()
    configs = _configs(raw["configs"])
    datasets = _datasets(raw.get("datasets"))
    axes = _grid(raw.get("grid"))
    seeds = raw.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds:
            raise SweepError(f"seeds: expected a list like [1, 2, 3], got {seeds!r}")
        if any(k == SEED_KEY for k, _, _ in axes):
            raise SweepError(f"seeds and grid.{SEED_KEY} both set the seed; keep one")
        axes.append((SEED_KEY, [normalize_key(SEED_KEY, s, "seeds")[1] for s in seeds], SEED_KEY))
    custom = raw.get("names") or {}
    if not isinstance(custom, dict):
        raise SweepError("names: expected a mapping section.key: label")
    custom = {str(k): _clean(str(v)) for k, v in custom.items()}
    written = axis_labels([w for _, _, w in axes], custom)  # keyed as written in the file
    labels = {k: custom.get(k, written[w]) for k, _, w in axes}  # a label may name the config key too
    common = {
        **overrides_from(raw.get("env_tuning"), "env_tuning"),
        **overrides_from(raw.get("set"), "set"),
    }
    cli = {**parse_assignments(list(cli_tune), "--tune"), **parse_assignments(list(cli_set), "--set")}
    command = raw.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if command is not None and (not isinstance(command, list) or not command):
        raise SweepError("command: expected a list like [python, my_job.py] (or a string)")
    jobs: list[Job] = []
    for (config_name, config_path, config_set), (dataset, data_set) in itertools.product(configs, datasets):
        for values in itertools.product(*(v for _, v, _ in axes)):
            params = dict(zip((k for k, _, _ in axes), values))
            parts = [config_name] + ([dataset] if dataset else [])
            parts += [name_part(labels[k], v) for k, v in params.items()]
            experiment_parts = [config_name] + [
                name_part(labels[k], v) for k, v in params.items() if k != SEED_KEY
            ]
            job_name = fit_name("_".join(parts))
            overrides = {**common, **config_set, **data_set, **params, **cli}
            jobs.append(
                Job(
                    name=job_name,
                    config=str(config_path),
                    config_name=config_name,
                    dataset=dataset,
                    seed=params.get(SEED_KEY, overrides.get(SEED_KEY)),
                    experiment="_".join(experiment_parts),
                    params={k: v for k, v in params.items() if k != SEED_KEY},
                    overrides=overrides,
                    output_dir=root_path / job_name,
                    index=len(jobs),
                )
            )
    names = [j.name for j in jobs]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise SweepError(f"two jobs would both be named {clash!r}; give grid keys distinct labels (names:)")
    if only:
        jobs = [j for j in jobs if any(fnmatch.fnmatchcase(j.name, pattern) for pattern in only)]
        if not jobs:
            raise SweepError(f"--only {' '.join(only)}: matches none of the {len(names)} jobs")
    gpus = raw.get("gpus")
    backend = raw.get("backend", "local")
    if backend not in BACKENDS:
        raise SweepError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    sweep = Sweep(
        name=name,
        file=path.resolve(),
        root=root_path,
        jobs=jobs,
        retries=_int(raw.get("retries"), "retries", 1),
        command=[str(c) for c in command] if command else None,
        gpus=[str(g) for g in gpus] if isinstance(gpus, list) else (str(gpus).split(",") if gpus else None),
        gpu_plan=plan_list(raw.get("gpu_plan"), "gpu_plan"),
        backend=backend,
        slurm=raw.get("slurm"),
    )
    if validate and sweep.command is None:
        validate_jobs(sweep)
    return sweep


def plan_list(raw: Any, where: str) -> list[int] | None:
    if raw is None:
        return None
    items = raw if isinstance(raw, list) else str(raw).split(",")
    try:
        values = [int(str(v).strip()) for v in items]
    except ValueError:
        raise SweepError(f"{where}: expected slot counts like 3,3,1,3, got {raw!r}") from None
    if not values or any(v < 0 for v in values):
        raise SweepError(f"{where}: expected slot counts >= 0, got {raw!r}")
    return values


def set_arguments(job: Job) -> list[str]:
    """The job's overrides as ``--set`` arguments, output folder last."""
    args: list[str] = []
    for key, value in job.overrides.items():
        args += ["--set", f"{key}={render_value(value)}"]
    return args + ["--set", f"paths.output_dir={job.output_dir}"]


def job_command(sweep: Sweep, job: Job) -> list[str]:
    base = sweep.command or [sys.executable, "-m", "trainer", "train"]
    return [*base, "--config", job.config, *set_arguments(job)]


def validate_jobs(sweep: Sweep) -> None:
    """Each job's config as the trainer will read it (types, values, files), before any job starts."""
    from trainer.config import ConfigError, load_config

    for job in sweep.jobs:
        args = set_arguments(job)
        try:
            load_config(job.config, args[1::2])
        except ConfigError as exc:
            first, *more = str(exc).splitlines()
            also = f" (and {len(more)} more: python -m trainer check-config shows them)" if more else ""
            raise SweepError(f"job {job.name}: {first}{also}") from exc


def job_info(job: Job) -> dict:
    """What sweep.json records about a job's identity (aggregate and the dashboard read it)."""
    info = dataclasses.asdict(job)
    info["output_dir"] = str(job.output_dir)
    info["log"] = str(job.log_path)
    return info
