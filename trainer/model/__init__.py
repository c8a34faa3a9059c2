"""The model to train, built from the config: ``loading`` (family, tokenizer, 4-bit loading, PEFT
adapters, size report) and ``moe_quant`` (4-bit storage for fused MoE expert weights).

What differs between model families lives in ``trainer/families/``; this package is what they share.
"""
