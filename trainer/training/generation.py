"""Generation-based evaluation: batched ``model.generate()`` on prompts, and task scoring on top.

Decoder-only models must see prompts left-padded, or a short prompt's continuation starts after
a run of padding and changes. We pad by hand (left, with the pad token or else eos), so the
caller's tokenizer is never modified. Every prompt keeps room to answer: prompt plus new tokens
never exceed the model's position limit (or ``max_total_length``); a prompt too long for that
loses its beginning, so the question at its end survives. The model runs in eval mode without
gradients; afterwards each module is back in the mode it was in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

_POSITION_LIMIT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
)


@dataclass
class Generations:
    """Continuations of each prompt, in the prompts' order, and what the length guard had to do."""

    texts: list[str]
    token_ids: list[list[int]]  # new tokens per prompt, eos and padding stripped
    prompts_truncated: int = 0  # prompts that lost their beginning to leave room for the answer
    capped_batches: int = 0  # batches that got fewer than max_new_tokens
    limit: int | None = None  # the prompt + new tokens limit that applied
    seconds: float = field(default=0.0)


def max_positions(model: Any) -> int | None:
    """The longest sequence the model's positions allow, from its config (None: no fixed limit, e.g. Mamba)."""
    config = getattr(model, "config", None)
    for key in _POSITION_LIMIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Tokens that end an answer: the tokenizer's eos plus any the model's generation config adds."""
    ids = []
    for source in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    num_beams: int = 1,
    do_sample: bool = False,
    batch_size: int = 8,
    max_total_length: int | None = None,
    stop_check: Callable[[], None] | None = None,
    **generate_kwargs: Any,
) -> Generations:
    """Continue every prompt; greedy by default, beam search with ``num_beams > 1``.

    ``generate_kwargs`` go to ``model.generate`` (``temperature``, ``top_p``, ``repetition_penalty``...).
    Works on a PEFT-wrapped model; pass an unwrapped one (``accelerator.unwrap_model``), not DDP.
    ``stop_check`` is called before every batch and may raise to abandon the generation (the trainer's
    ``StopFlag.check`` on SIGTERM); it is called ``batches(len(prompts), batch_size)`` times.
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError("generate() handles decoder-only models; this model is encoder-decoder")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        # MoE load-balancing loss is a training term; during cached generation transformers 5
        # computes it with the full-length mask against one step's router logits and fails.
        generate_kwargs.setdefault("output_router_logits", False)
    stop_ids = _stop_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids or [None])[0]
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    limits = [n for n in (max_positions(model), max_total_length) if n]
    limit = min(limits) if limits else None
    # Room every prompt keeps for its answer; at most half the limit, so prompts keep the other half.
    reserve = max(min(max_new_tokens, limit // 2), min_new_tokens, 1) if limit else 0
    if limit and reserve >= limit:
        raise ValueError(
            f"min_new_tokens={min_new_tokens} leaves no room for a prompt within {limit} positions"
        )

    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    if any(not ids for ids in encoded):
        raise ValueError("an empty prompt has nothing to continue; every prompt needs at least one token")
    result = Generations(texts=[""] * len(prompts), token_ids=[[] for _ in prompts], limit=limit)
    if limit:
        for i, ids in enumerate(encoded):
            if len(ids) > limit - reserve:
                encoded[i] = ids[len(ids) - (limit - reserve) :]
                result.prompts_truncated += 1
    # Longest first: similar lengths share a batch (less padding) and an out-of-memory shows at once.
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
    device = _model_device(model)
    modes = [(module, module.training) for module in model.modules()]  # restored exactly afterwards
    start = time.perf_counter()
    model.eval()
    try:
        with torch.no_grad():
            for b in range(0, len(order), batch_size):
                if stop_check is not None:
                    stop_check()
                batch = order[b : b + batch_size]
                width = max(len(encoded[i]) for i in batch)
                new_tokens = min(max_new_tokens, limit - width) if limit else max_new_tokens
                result.capped_batches += new_tokens < max_new_tokens
                input_ids = torch.tensor([[pad_id] * (width - len(encoded[i])) + encoded[i] for i in batch])
                mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in batch])
                output = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=min(min_new_tokens, new_tokens),
                    num_beams=num_beams,
                    do_sample=do_sample,
                    num_return_sequences=1,
                    pad_token_id=pad_id,
                    eos_token_id=stop_ids or None,
                    use_cache=True,
                    **generate_kwargs,
                )
                for row, i in enumerate(batch):
                    new = output[row, width:].tolist()
                    end = next((k for k, t in enumerate(new) if t in stop_ids), len(new))
                    result.token_ids[i] = new[:end]
                    result.texts[i] = tokenizer.decode(new[:end], skip_special_tokens=True)
    finally:
        for module, training in modes:
            module.train(training)
    result.seconds = time.perf_counter() - start
    if result.prompts_truncated or result.capped_batches:
        log.warning(
            "generation length guard (limit %s): %d prompts lost their beginning, %d batches got fewer new tokens",
            limit,
            result.prompts_truncated,
            result.capped_batches,
        )
    return result


def batches(prompts: int, batch_size: int) -> int:
    """How many batches ``generate`` runs for ``prompts`` prompts (ranks with fewer pad their stop checks)."""
    return -(-prompts // batch_size)


def generate_texts(model: Any, tokenizer: Any, prompts: list[str], **kwargs: Any) -> list[str]:
    """The continuations only; see ``generate`` for the arguments."""
    return generate(model, tokenizer, prompts, **kwargs).texts


def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: Any,
    examples: list[dict],
    gen_kwargs: dict[str, Any] | None = None,
    *,
    num_samples: int = 3,
) -> dict[str, Any]:
    """Generate answers to ``examples`` and score them with ``task``.

    Returns ``{"task", "metrics", "samples", "generation"}``: ``metrics`` and ``task`` go into
    eval_log.jsonl as they are; ``samples`` holds a few prompts with prediction and target for a
    human to read; ``generation`` says what the length guard did and how long it took.
    """
    kwargs = {"max_new_tokens": task.max_new_tokens, **(gen_kwargs or {})}
    prompts = [task.prompt(e) for e in examples]
    generations = generate(model, tokenizer, prompts, **kwargs)
    samples = [
        {"prompt": p, "prediction": text, "target": task.target(e)}
        for p, text, e in list(zip(prompts, generations.texts, examples))[:num_samples]
    ]
    return {
        "task": task.name,
        "metrics": task.score(generations.texts, examples),
        "samples": samples,
        "generation": {
            "prompts_truncated": generations.prompts_truncated,
            "capped_batches": generations.capped_batches,
            "limit": generations.limit,
            "seconds": round(generations.seconds, 3),
        },
    }
