"""transformers' search for packed documents (a host sync on a GPU) skipped where the model makes its own
positions (trainer/model/own_positions.py), and still run where rows carry their own."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils

from trainer.model import own_positions as positions
from trainer.training.step import forward_loss


@pytest.fixture
def searches(monkeypatch):
    """How often transformers' own search ran (a spy under the kit's wrapper)."""
    original, calls = masking_utils.find_packed_sequence_indices, []

    def spy(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    return calls


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()  # forwards below as training runs them: use_cache=False


def test_without_position_ids_the_search_is_answered_on_the_host(searches):
    model, ids = tiny_llama(), torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        outside = model(input_ids=ids, use_cache=False).logits
        assert len(searches) == 1  # transformers looked in the positions it made itself
        with positions.own_positions({"input_ids": ids}):
            inside = model(input_ids=ids, use_cache=False).logits
    assert len(searches) == 1  # ... and inside, did not
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert not getattr(positions._state, "own", False)  # left as it was


def test_packed_rows_with_their_own_positions_are_still_searched(searches):
    model, ids = tiny_llama(), torch.randint(0, 64, (1, 12))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # two documents in one row
    with torch.no_grad():
        outside = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        with positions.own_positions({"input_ids": ids, "position_ids": packed}):
            inside = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        plain = model(input_ids=ids, use_cache=False).logits
    assert len(searches) == 3
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert not torch.allclose(inside[0, 5:], plain[0, 5:])  # the second document did not see the first


def test_the_steps_loss_runs_its_forward_inside(searches):
    """The training step's loss (``step.HeadLoss`` / ``FullCrossEntropy``) wraps the model's forward."""
    model = tiny_llama().train()
    ids = torch.randint(0, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "token_mask": torch.ones_like(ids),
             "position_ids": torch.arange(12).expand(2, -1)}  # fmt: skip
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    ce_sum, _ = forward_loss(model, batch, accelerator)
    assert torch.isfinite(ce_sum) and not searches
