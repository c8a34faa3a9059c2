"""The small interface every model family implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message names the missing file or setting."""


@dataclass(frozen=True)
class Family:
    """What the loop needs to know about a model family.

    ``packing``: whether packed sequences stay separate. Causal LMs in transformers 5 build a
    block-diagonal mask from restarting ``position_ids``; models that ignore positions
    (linear attention, convolutions) must say False unless they take explicit boundaries.
    """

    name: str
    model_types: tuple[str, ...]
    default_lora_targets: Any
    packing: bool
    load: Callable[..., Any]
    lora_variants: tuple[str, ...] = ("lora", "dora", "rslora")
    quantizable: bool = True
    notes: dict = field(default_factory=dict)
