"""The small interface every model family implements."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message names the missing file or setting."""


def has_document_boundaries(batch: dict) -> bool:
    """True when a row holds more than one document: its ``position_ids`` restart inside its real tokens
    (``token_mask``; collate's right padding, at position 0, is not a document)."""
    positions = batch.get("position_ids")
    if positions is None or positions.shape[-1] < 2:
        return False
    restarts = positions[:, 1:] != positions[:, :-1] + 1
    real = batch.get("token_mask")
    if real is not None:
        restarts &= real[:, 1:].bool()
    return bool(restarts.any())


def causal_inputs(batch: dict) -> dict:
    """What transformers' causal LMs take: restarting position_ids keep packed documents apart.

    transformers 5 builds the block-diagonal mask from ``position_ids`` only when no 2-D attention_mask
    and no cache are given (``masking_utils._preprocess_mask_arguments``); with a padding mask it builds a
    plain causal one, and packed documents would see each other. So a batch that is both packed and
    padded goes without its mask: the padding is on the right, where causal attention never looks from a
    real token, and each pad token (position 0) becomes a one-token document of its own. An unpacked
    padded batch keeps its mask (a MoE router's aux loss uses it to leave padding out)."""
    keys = ("input_ids", "position_ids", "attention_mask")
    packed = has_document_boundaries(batch)
    if "attention_mask" in batch and packed:
        keys = ("input_ids", "position_ids")
    elif not packed and counts_from_zero(batch.get("position_ids")):
        # transformers' own default positions: passing them would only make it look for packed documents
        # on the GPU (a host sync per forward) to find none.
        keys = ("input_ids", "attention_mask")
    return {k: batch[k] for k in keys if k in batch}


def unmask_right_padding(batch: dict) -> dict:
    """The batch with its right padding unmasked and the padding's positions counting on from each row's last
    real token: what a layer stack replayed from CUDA graphs takes (``step.step_inputs``).

    Causal attention never looks right from a real token, so the pad tokens (their labels ignored) change no
    real token's output. Without the mask, a batch holding a short row (an epoch's last) calls the layers as
    the full batches did and replays, where with it every layer would run eagerly beside the graphs' pool: one
    more set of activations (8.8 GiB more for Llama-1B at 4 x 2048, bench/RESULTS.md session 23)."""
    if "attention_mask" not in batch:
        return batch
    import torch  # here: `needs` reads families without torch installed

    real = batch["token_mask"].bool()
    positions = batch["position_ids"]
    lengths = real.sum(dim=1, keepdim=True)
    last = positions.gather(1, (lengths - 1).clamp(min=0))
    index = torch.arange(real.shape[1], device=real.device).expand_as(positions)
    counted_on = torch.where(real, positions, last + 1 + index - lengths)
    return {**{k: v for k, v in batch.items() if k != "attention_mask"}, "position_ids": counted_on}


def counts_from_zero(positions) -> bool:
    """True when every row's ``position_ids`` are 0, 1, 2, ... (what a model assumes when given none)."""
    if positions is None:
        return False
    import torch  # here: `needs` reads families without torch installed

    return bool((positions == torch.arange(positions.shape[-1], device=positions.device)).all())


def _nothing(*args) -> None:
    return None


def _same_config(hf_config, cfg):
    return hf_config


def _nothing_to_skip(*args) -> tuple[str, ...]:
    return ()


def _transformers_kernels(hf_config) -> str:
    return "transformers"


def _transformers_paths(hf_config) -> dict[str, str | None]:
    return {"transformers": None}


def _no_checks(hf_config, path: str) -> dict:
    return {}


def _no_fast_modules(model, path: str) -> dict:
    return {}


# The kernel path chosen for each model type while a model is being set up (trainer/model/kernel_choice.py:
# a failed self-check or ``model.kernel_path`` can move a run off the first usable path); the families'
# ``kernel_path`` hooks answer with it, so every hook agrees on the path that will run.
_CHOSEN: dict[str, str] = {}


@contextlib.contextmanager
def kernel_path_chosen(model_type: str, path: str):
    """Within this block, ``current_kernel_path`` answers ``path`` for ``model_type``."""
    previous = _CHOSEN.get(model_type)
    _CHOSEN[model_type] = path
    try:
        yield
    finally:
        if previous is None:
            _CHOSEN.pop(model_type, None)
        else:
            _CHOSEN[model_type] = previous


def current_kernel_path(model_type: str, paths: dict[str, str | None]) -> str:
    """The path chosen for this model type (see ``kernel_path_chosen``), else the first of ``paths`` (best
    first; path -> why it cannot run here, None when it can) that can run here."""
    chosen = _CHOSEN.get(model_type)
    if chosen in paths:
        return chosen
    return next(path for path, why_not in paths.items() if why_not is None)


@dataclass(frozen=True)
class Family:
    """What the loop needs to know about a model family.

    ``packing``: whether packed sequences stay separate. Causal LMs in transformers 5 build a
    block-diagonal mask from restarting ``position_ids``; models that ignore positions
    (linear attention, convolutions) must say False unless they take explicit boundaries.

    Hooks, called in this order by ``loading.load_for_training`` and the step's loss (training/step.py):
    ``configure(hf_config, cfg)`` returns the model config adjusted for this run and machine (whatever the
    kernel path: it is chosen next); ``kernel_paths(hf_config)`` lists every implementation the family
    has for this model type, best first, each with why it cannot run here (None when it can: the values
    ``model.kernel_path`` accepts); ``kernel_checks(hf_config, path)`` gives that path's start-up
    self-checks (name -> ``check(device, dtype)`` returning the largest relative error against the
    reference; empty for a reference path), run on a GPU by trainer/model/kernel_choice.py;
    ``kernel_path(hf_config)`` names the implementation that will run (``current_kernel_path``: the one
    chosen, while the model is set up; the ``model_report`` event), and ``load`` binds its kernels;
    ``fast_checks(hf_config, path)`` and ``fast_modules(model, path)``: on a CUDA fast path, the family's
    own module swaps onto fused kernels (trainer/fastpath ``apply_to_family``: checks like kernel_checks',
    and the swap itself, returning name -> modules swapped);
    ``check_lora(cfg, hf_config, targets)`` raises ``ModelLoadError`` for LoRA settings the family
    cannot train, before any weights load; ``quantization_skip(hf_config, cfg)`` lists modules that
    bitsandbytes must leave unquantized; ``model_inputs(batch)`` turns a collated batch into the
    model's keyword arguments (its logits may come back flattened; the loop reshapes them);
    ``eager_call(kwargs)``: see the field.
    """

    name: str
    model_types: tuple[str, ...]
    default_lora_targets: Any  # a list, or a function of the model config (Mamba's follow the kernel path)
    packing: bool
    load: Callable[..., Any]
    lora_variants: tuple[str, ...] = ("lora", "dora", "rslora")
    quantizable: bool = True
    notes: dict = field(default_factory=dict)
    # Hooks; the defaults suit transformers' causal LMs, GLA and Mamba override them.
    model_inputs: Callable[[dict], dict] = causal_inputs
    configure: Callable[[Any, Any], Any] = _same_config
    kernel_path: Callable[[Any], str] = _transformers_kernels
    kernel_paths: Callable[[Any], dict[str, str | None]] = _transformers_paths
    kernel_checks: Callable[[Any, str], dict] = _no_checks
    # Whether a CUDA run of this family takes the fast path's fused LoRA projections and loss beside its own
    # kernels (trainer/model/loading.py ``family_fast_path``); GLA does not: measured, it bought nothing there.
    fast_path: bool = False
    fast_checks: Callable[[Any, str], dict] = _no_checks
    fast_modules: Callable[[Any, str], dict] = _no_fast_modules
    quantization_skip: Callable[[Any, Any], tuple[str, ...]] = _nothing_to_skip
    check_lora: Callable[[Any, Any, Any], None] = _nothing
    # A GLA or Mamba family whose decoder layers may replay from CUDA graphs (trainer/fastpath/stack_graphs.py)
    # says which layer calls a graph cannot record (kwargs -> True: that call runs eagerly); None: never graphed.
    eager_call: Callable[[dict], bool] | None = None
