"""fla's Triton kernels start from tuned configurations shipped with the kit instead of autotuning on every machine.

The first time fla meets a kernel shape on a machine, Triton's autotuner compiles every candidate configuration
(block sizes, warps, pipeline stages; ptxas each time) and times it: on a fresh H200 that was about 7 minutes
before step 1 of configs/tiny-gla.yaml (issue 30). Triton keeps the results on disk (fla turns its
``cache_results`` on, ``FLA_CACHE_RESULTS=1``, under ``TRITON_CACHE_DIR``), so later runs on that machine start
in seconds; a fresh machine (a container, a new cluster node) pays again.

fla can take each kernel's configuration from a JSON file instead (``FLA_CONFIG_DIR``, one file per kernel,
entries keyed by the autotune key: the key arguments' values and every tensor argument's dtype; the lookup
``FLA_CACHE_MODE``). The kit ships such files for the cards it was measured on, ``fla_configs/<GPU name>/``
(written by ``bench/gla_startup.py export`` from a run's Triton autotune cache: the configuration Triton picked,
with its timing), gives every fla autotuner the lookup (``route_autotuners_through_lookup``: fla builds most of
its kernels with Triton's plain autotuner, which has none) and turns it on in ``strict`` mode: a kernel whose exact key is in its file compiles
that one configuration; any other shape, dtype or card autotunes as before, once per machine. The start-up
self-check still measures the kernels that run. ``FLA_CONFIG_DIR`` or ``FLA_CACHE_MODE`` set by the user are
left alone (``FLA_CACHE_MODE=disabled`` autotunes everything, as before).

A card with no folder of its own borrows one measured on a card of the same architecture and size
(``fla_configs/cards.json``: compute capability and multiprocessor count), e.g. an H200 the H100 SXM's: the same
SMs run the same kernels, and a configuration decides speed, never results. Without this a fresh H200 spent
minutes autotuning GLA-340M's kernels (bench/RESULTS.md, session 23).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG_ROOT = Path(__file__).resolve().parent / "fla_configs"
CARDS_FILE = "cards.json"  # in CONFIG_ROOT: the card each folder was measured on
USER_SETTINGS = ("FLA_CONFIG_DIR", "FLA_CACHE_MODE")
_ANNOUNCED: set[str] = set()


def config_dir(gpu_name: str) -> Path:
    """The kit's folder for this GPU model (fla's sanitized device name, e.g. ``NVIDIA_H100_80GB_HBM3``)."""
    return CONFIG_ROOT / gpu_name


def this_card() -> dict:
    """GPU 0's architecture and size, as ``cards.json`` records a card."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"capability": [props.major, props.minor], "multiprocessors": props.multi_processor_count}


def folder_for(gpu_name: str, card: dict) -> tuple[Path, bool] | None:
    """The kit's folder for this card, and whether it is borrowed: its own, else the first one measured on a
    card with the same compute capability and multiprocessor count; None where neither is shipped."""
    own = config_dir(gpu_name)
    if own.is_dir():
        return own, False
    cards_file = CONFIG_ROOT / CARDS_FILE
    shipped = json.loads(cards_file.read_text()) if cards_file.is_file() else {}
    for name, measured_on in sorted(shipped.items()):
        if measured_on == card and config_dir(name).is_dir():
            return config_dir(name), True
    return None


def use_tuned_configs() -> Path | None:
    """Point fla at the kit's tuned configurations for GPU 0's model (process-wide); the folder, or None where
    there is none for this card, no CUDA, no fla, or the user chose fla's settings."""
    import torch

    if not torch.cuda.is_available() or any(name in os.environ for name in USER_SETTINGS):
        return _applied_folder()
    try:
        from fla.ops.utils import cache

        gpu_name = cache.get_gpu_info()
        found = folder_for(gpu_name, this_card())
    except Exception:  # noqa: BLE001 - fla or triton absent or broken, or no device to name: nothing to configure
        return None
    if found is None:
        return None
    folder, borrowed = found
    routed = route_autotuners_through_lookup(cache.CachedAutotuner)
    # fla reads FLA_CONFIG_DIR at every lookup, and its mode from a module global it sets at import.
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    # the variable for child processes (data workers), which read it when they import fla
    os.environ["FLA_CACHE_MODE"] = cache.FlaCacheMode.STRICT.value
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.STRICT
    if str(folder) not in _ANNOUNCED:
        _ANNOUNCED.add(str(folder))
        measured = (
            f", measured there for this {gpu_name} of the same architecture and size" if borrowed else ""
        )
        print(
            f"fla: tuned Triton configurations for {folder.name}{measured} ({len(list(folder.glob('*.json')))} "
            f"kernels, lookup on for {routed} autotuners); shapes not among them autotune once per machine",
            flush=True,
        )
    return folder


def route_autotuners_through_lookup(cached_class) -> int:
    """Give every plain Triton autotuner of fla's loaded kernels fla's config lookup; how many have it now.

    fla builds 27 of its kernel files with its own ``fla_cache_autotune`` (the lookup) and the rest, among them
    the chunk state kernels, the fused recurrence, the norms and SwiGLU that GLA runs, with ``triton.autotune``;
    fla's ``configure_fla_cache_autotune()`` would fix that only before its kernels are decorated, and importing
    it imports them all. fla's ``CachedAutotuner`` is Triton's ``Autotuner`` plus a ``run`` that looks the key up
    first (and the kernel's name), so a class swap gives an already built autotuner the same lookup."""
    import sys

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    routed = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            while isinstance(value, KernelInterface):  # heuristics -> autotuner -> jit, in either order
                if type(value) is Autotuner:
                    value.__class__ = cached_class
                    value.kernel_name = value.base_fn.__name__
                if isinstance(value, cached_class):
                    routed.add(id(value))
                value = getattr(value, "fn", None)
    return len(routed)


def _applied_folder() -> Path | None:
    """The kit's folder where an earlier call (or a parent process) already pointed fla at it."""
    folder = os.environ.get("FLA_CONFIG_DIR")
    if folder and Path(folder).resolve().parent == CONFIG_ROOT and Path(folder).is_dir():
        return Path(folder)
    return None
