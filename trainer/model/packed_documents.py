"""transformers' search for packed documents, answered from the host's copy of the positions.

In every forward a causal LM looks for packed documents in its ``position_ids``
(``masking_utils.find_packed_sequence_indices``, from ``_preprocess_mask_arguments``): a new document wherever
a position is not the previous one plus 1 (``fastpath.attention.document_ids``), then an ``.all()`` to return
None where every row holds one document. On a GPU that ``.all()`` stalls the host until the device has run all that is queued, and
the device then waits while the host launches what follows: one ``cudaStreamSynchronize`` per micro-batch
(bench/RESULTS.md: session 33 for positions the model makes itself, session 36 for packed rows under FSDP).

The training step holds the positions on the host before it copies them, so the answer is read there: inside
``documents_known(host_inputs)`` the search returns None where each row is one document (also where no
positions are passed: the model counts 0, 1, 2, ... itself) and otherwise the document ids, computed on the
device from the positions it was given, without the check. Inputs already on a device, and forwards outside
(generation), are searched by transformers as before.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from trainer.fastpath.attention import document_ids

_state = threading.local()
_MARK = "_finetune_kit_documents_known"


def holds_several_documents(position_ids: torch.Tensor) -> bool:
    """Whether some row's positions restart: what transformers' ``.all()`` decides, read where they are."""
    return bool((position_ids[:, 1:] != position_ids[:, :-1] + 1).any())


def _answering(original):
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids):
        packed = getattr(_state, "packed", None)
        if packed is None:
            return original(position_ids)
        return document_ids(position_ids) if packed else None

    setattr(find_packed_sequence_indices, _MARK, True)
    return find_packed_sequence_indices


def install() -> bool:
    """Wrap transformers' function once; False where this transformers has none (nothing to answer)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        masking_utils.find_packed_sequence_indices = _answering(original)
    return True


def known_on_host(host_inputs: dict) -> bool | None:
    """Whether the forward's rows hold several documents, from its keyword arguments before their copy to the
    device; None where the positions are on a device already (reading them would be the stall) or not
    (batch, length) as transformers reads them."""
    positions = host_inputs.get("position_ids")
    if positions is None:
        return False
    if positions.device.type != "cpu" or positions.dim() != 2:
        return None
    return holds_several_documents(positions)


@contextlib.contextmanager
def documents_known(host_inputs: dict):
    """Forwards inside take the search's answer from ``host_inputs`` (what is passed to them, still on the
    host) instead of asking the device."""
    packed = known_on_host(host_inputs)
    if packed is None or not install():
        yield
        return
    before = getattr(_state, "packed", None)
    _state.packed = packed
    try:
        yield
    finally:
        _state.packed = before
