"""What each model family needs installed beyond the ``train`` extra, read from a config without loading it.

The launcher asks this (``python -m trainer needs``) after its base set-up and installs what is missing,
and ``train`` refuses early with the pip command instead of transformers' "model type ... not
recognized". So it must stay cheap: standard library only (huggingface_hub for a hub id's cached
config), never an import of the packages it checks for (fla alone costs seconds).

The family comes from the checkpoint's ``model_type`` as in ``family_for``: ``MODEL_TYPES`` below is
where the GLA and Mamba families take theirs from, so the two cannot disagree.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Extra:
    """An optional-dependencies extra of pyproject.toml, and the modules that show it is installed."""

    name: str
    modules: tuple[str, ...]
    what: str  # the packages, as a user knows them


GLA = Extra("gla", ("fla", "triton"), "flash-linear-attention")
# Compiled against the installed torch (minutes to an hour): advised on a GPU machine, never installed by
# the launcher. Without them Mamba trains on its reference paths (mambapy, fla's SSD or transformers').
MAMBA_KERNELS = Extra("mamba-kernels", ("mamba_ssm", "causal_conv1d"), "mamba_ssm and causal_conv1d")


@dataclass(frozen=True)
class Needs:
    required: tuple[Extra, ...] = ()  # the model cannot load without them: installed by the launcher
    gpu_advised: tuple[Extra, ...] = ()  # faster kernels on an NVIDIA GPU; a line says how to get them


MODEL_TYPES: dict[str, tuple[str, ...]] = {"gla": ("gla",), "mamba": ("mamba", "mamba2")}
FAMILY_NEEDS: dict[str, Needs] = {"gla": Needs(required=(GLA,)), "mamba": Needs(gpu_advised=(MAMBA_KERNELS,))}


def installed(extra: Extra) -> bool:
    """Every module of the extra can be found (found, not imported: importing fla costs seconds)."""
    for module in extra.modules:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def nvidia_gpu() -> bool:
    """An NVIDIA GPU answers, by the same test as scripts/setup_venv.sh (no torch import)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _config_json(cfg) -> Path | None:
    """The model's config.json: in its local folder, else a hub id's copy in the local cache (no download)."""
    name = cfg.model.name_or_path
    folder = Path(name).expanduser()
    if folder.exists() or name.startswith((".", "/", "~")):
        path = folder / "config.json"
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(
        name, "config.json", cache_dir=cfg.paths.cache_dir, revision=cfg.model.revision
    )
    return Path(cached) if isinstance(cached, str) else None


def model_type(cfg) -> str | None:
    """config.json's model_type, or None where there is no readable local copy (loading reports that)."""
    path = _config_json(cfg)
    if path is None:
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def family_name(cfg) -> str:
    """The family ``family_for`` will pick: ``model.family`` when forced, else by model_type."""
    if cfg.model.family != "auto":
        return cfg.model.family
    kind = model_type(cfg)
    return next((family for family, types in MODEL_TYPES.items() if kind in types), "causal")


def required_extras(cfg) -> list[Extra]:
    return list(FAMILY_NEEDS.get(family_name(cfg), Needs()).required)


def missing_extras(cfg) -> list[Extra]:
    return [extra for extra in required_extras(cfg) if not installed(extra)]


def install_command(extras: list[str], no_build_isolation: bool = False) -> str:
    """The pip line that installs the kit with these extras, runnable from the current folder."""
    names = ",".join(["train", *extras])
    if Path.cwd().resolve() == REPO:
        target = f".[{names}]"
    else:
        target = shlex.quote(f"{REPO}[{names}]")
    flag = " --no-build-isolation" if no_build_isolation else ""
    return f"pip install{flag} -e {target}"


def advice(cfg) -> list[str]:
    """One line per faster-kernel extra this machine could use and lacks (Mamba on an NVIDIA GPU)."""
    family = family_name(cfg)
    wanted = [e for e in FAMILY_NEEDS.get(family, Needs()).gpu_advised if not installed(e)]
    if not wanted or not nvidia_gpu():
        return []
    return [
        f"{family}: for the fast CUDA kernels ({extra.what}), which compile against your torch, run "
        f"`{install_command([extra.name], no_build_isolation=True)}` (no prebuilt wheel for your torch/CUDA: "
        f"bench/build_mamba_kernels.sh; see docs/families.md); training on the reference path meanwhile"
        for extra in wanted
    ]


def require_installed(cfg) -> None:
    """Raise ModelLoadError naming the pip command when the config's model needs an extra that is missing."""
    missing = missing_extras(cfg)
    if not missing:
        return
    from trainer.families.base import ModelLoadError

    names = [extra.name for extra in missing]
    kind = model_type(cfg) or family_name(cfg)
    raise ModelLoadError(
        f"model.name_or_path: {cfg.model.name_or_path} ({kind}) needs {', '.join(e.what for e in missing)}, "
        f"which is not installed; install it with: {install_command(names)}"
    )
