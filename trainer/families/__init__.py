"""Model families: each answers how to load, what LoRA targets by default, where MoE routers are.

The family comes from the checkpoint's ``model_type`` (its config.json), never from substrings
of the model name; ``model.family`` in the config can force one.
"""

from __future__ import annotations

from trainer.families.base import Family, ModelLoadError
from trainer.families.causal import CAUSAL

FAMILIES: dict[str, Family] = {CAUSAL.name: CAUSAL}


def register(family: Family) -> None:
    FAMILIES[family.name] = family


def _load_optional_families() -> None:
    """GLA and Mamba live in their own modules; a missing optional dependency must not break causal LMs."""
    for module in ("trainer.families.gla", "trainer.families.mamba"):
        try:
            __import__(module)
        except ModuleNotFoundError as exc:
            if not exc.name or not exc.name.startswith("trainer."):
                continue
            if exc.name != module:
                raise


def family_for(model_type: str, forced: str = "auto") -> Family:
    """Pick the family by config.json's model_type; anything not claimed by another family is causal."""
    _load_optional_families()
    if forced != "auto":
        if forced not in FAMILIES:
            raise ModelLoadError(f"model.family: '{forced}' is not available (have: {', '.join(FAMILIES)})")
        return FAMILIES[forced]
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    return CAUSAL


def family_inputs(model, batch: dict) -> dict:
    """The keyword arguments this model's forward takes for a collated batch (see Family.model_inputs).

    Looked up by the model's own type, through DDP and PEFT wrappers, since its forward is what takes them.
    """
    config = getattr(getattr(model, "module", model), "config", None)
    return family_for(getattr(config, "model_type", "") or "").model_inputs(batch)


__all__ = ["FAMILIES", "Family", "ModelLoadError", "family_for", "family_inputs", "register"]
