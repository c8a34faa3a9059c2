"""The sweep file, expanded into jobs: base configs × datasets × override grid × seeds.

Every job gets a readable name (``job_names``) and its own folder ``<root>/<name>``. Relative
paths are read from the working directory, as the trainer's own config does. Every field is
checked here with its own message, before anything starts. docs/sweeps.md has the format.
"""

from __future__ import annotations

import fnmatch
import itertools
import shlex
from pathlib import Path
from typing import Any

from trainer.sweep.job_names import axis_labels, fit_name, name_part, slug
from trainer.sweep.jobs import Job, Sweep, SweepError, set_arguments
from trainer.sweep.overrides import did_you_mean, normalize_key, overrides_from, parse_assignments

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
            entries.append((slug(path.stem), path, {}))
    elif isinstance(raw, dict) and raw:
        for name, item in raw.items():
            where = f"configs.{name}"
            if isinstance(item, dict):
                unknown = set(item) - {"path", "set"}
                if unknown:
                    raise SweepError(f"{where}: unknown keys {sorted(unknown)} (expected path and set)")
                entries.append((slug(str(name)), _path(item.get("path"), f"{where}.path"),
                                overrides_from(item.get("set"), f"{where}.set")))  # fmt: skip
            else:
                entries.append((slug(str(name)), _path(item, where), {}))
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
    return [(slug(str(name)), overrides_from(values, f"datasets.{name}")) for name, values in raw.items()]


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
            f"{did_you_mean(str(unknown[0]), TOP_LEVEL_KEYS)}; "
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
    name = slug(str(raw.get("name") or path.stem))
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
    custom = {str(k): slug(str(v)) for k, v in custom.items()}
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
