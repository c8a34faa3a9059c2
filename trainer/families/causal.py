"""Causal LMs through transformers' Auto classes: dense and mixture-of-experts, 4-bit or not."""

from __future__ import annotations

from trainer.families.base import Family


def load_causal(model_cfg, config, **kwargs):
    """Any AutoModelForCausalLM: hub id or local folder, random init from its config.json if asked."""
    from transformers import AutoModelForCausalLM

    if kwargs.pop("from_config", False):
        return AutoModelForCausalLM.from_config(
            config, dtype=kwargs.get("dtype"), trust_remote_code=model_cfg.trust_remote_code
        )
    return AutoModelForCausalLM.from_pretrained(
        model_cfg.name_or_path,
        revision=model_cfg.revision,
        trust_remote_code=model_cfg.trust_remote_code,
        **kwargs,
    )


CAUSAL = Family(
    name="causal",
    model_types=(),  # the fallback: whatever no other family claims
    # q/k/v/o as the original kit did; "all-linear" is one setting away.
    default_lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
    packing=True,
    load=load_causal,
)
