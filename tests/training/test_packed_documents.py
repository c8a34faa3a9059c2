"""transformers' search for packed documents (a host sync per forward on a GPU) answered from the host's copy of
the positions (trainer/model/packed_documents.py), with the forward's result unchanged."""

from __future__ import annotations

import contextlib
import inspect
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, masking_utils

from trainer.model import packed_documents as documents
from trainer.training.step import forward_loss

# transformers' own function, whether or not the kit wrapped it already (functools.wraps keeps it)
transformers_search = inspect.unwrap(masking_utils.find_packed_sequence_indices)


@pytest.fixture
def searches(monkeypatch):
    """How often transformers' own search ran (a spy under the kit's wrapper)."""
    calls = []

    def spy(position_ids):
        calls.append(position_ids.shape)
        return transformers_search(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    return calls


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()  # forwards below as training runs them: use_cache=False


PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
PADDED = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
ONE_EACH = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])


@pytest.mark.parametrize("positions", [PACKED, PADDED, ONE_EACH], ids=["packed", "padded", "one-each"])
def test_the_answer_is_transformers_own(positions):
    """None where transformers returns None, its very document ids elsewhere."""
    expected = transformers_search(positions)
    assert documents.holds_several_documents(positions) == (expected is not None)
    if expected is not None:
        assert torch.equal(documents.document_ids(positions), expected)
    assert documents.document_ids(torch.tensor([[3, 4, 0, 1, 0, 0]])).tolist() == [[0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize(
    "positions", [None, PACKED, PADDED, ONE_EACH], ids=["own", "packed", "padded", "one-each"]
)
def test_forwards_inside_are_answered_on_the_host_with_the_same_logits(searches, positions):
    model, ids = tiny_llama(), torch.randint(0, 64, (2, 12))
    inputs = {"input_ids": ids} if positions is None else {"input_ids": ids, "position_ids": positions}
    with torch.no_grad():
        outside = model(**inputs, use_cache=False).logits
        assert len(searches) == 1  # transformers looked itself
        with documents.documents_known(inputs):
            inside = model(**inputs, use_cache=False).logits
    assert len(searches) == 1  # ... and inside, did not
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert getattr(documents._state, "packed", None) is None  # left as it was


def test_packed_documents_still_do_not_see_each_other(searches):
    model, ids = tiny_llama(), torch.randint(0, 64, (2, 12))
    with torch.no_grad(), documents.documents_known({"input_ids": ids, "position_ids": PACKED}):
        packed = model(input_ids=ids, position_ids=PACKED, use_cache=False).logits
        plain = model(input_ids=ids, use_cache=False).logits
    assert not searches
    assert not torch.allclose(packed[0, 5:], plain[0, 5:])  # the second document did not see the first
    torch.testing.assert_close(packed[1], plain[1], rtol=0, atol=1e-6)  # one document: a plain causal row


def test_positions_already_on_a_device_are_left_to_transformers():
    """Reading them would be the stall the answer avoids: no answer, transformers searches."""
    assert documents.known_on_host({"position_ids": PACKED.to("meta")}) is None
    assert documents.known_on_host({"position_ids": PACKED[0]}) is None  # not (batch, length)
    assert documents.known_on_host({"position_ids": PACKED}) is True
    assert documents.known_on_host({"position_ids": ONE_EACH}) is False
    assert documents.known_on_host({"input_ids": PACKED}) is False  # the model counts 0, 1, 2, ... itself


def test_the_steps_loss_runs_its_forward_inside(searches):
    """The training step's loss (``step.HeadLoss`` / ``FullCrossEntropy``) answers packed rows from the host too,
    with the loss the search gives."""
    model = tiny_llama().train()
    ids = torch.randint(0, 64, (2, 12))
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "token_mask": torch.ones_like(ids),
        "position_ids": PACKED,
    }
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    ce_sum, _ = forward_loss(model, batch, accelerator)
    assert torch.isfinite(ce_sum) and not searches
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=PACKED, use_cache=False).logits.float()
    assert len(searches) == 1
    reference = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(ce_sum.detach(), reference, rtol=1e-5, atol=1e-5)
