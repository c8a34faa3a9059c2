"""transformers' search for packed documents, answered on the host where the model makes its own positions.

A causal LM given no ``position_ids`` builds them as 0, 1, 2, ... for every row, and then looks in them for
packed documents (``masking_utils.find_packed_sequence_indices``, from ``_preprocess_mask_arguments``): an
``.all()`` on a GPU tensor, so the host waits for the GPU in every forward, and the GPU then waits while the
host launches what follows (bench/RESULTS.md, session 33: one ``cudaStreamSynchronize`` a step). Positions it
made itself hold one document per row, so the answer is known: inside ``own_positions`` it is given on the
host. A forward given its own ``position_ids`` (packed rows, ``families.base.causal_inputs``) is looked at as
before.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()
_MARK = "_finetune_kit_own_positions"


def _skipping(original):
    def find_packed_sequence_indices(position_ids):
        if getattr(_state, "own", False):
            return None  # positions the model counted from zero itself: one document per row
        return original(position_ids)

    setattr(find_packed_sequence_indices, _MARK, True)
    return find_packed_sequence_indices


def install() -> bool:
    """Wrap transformers' function once; False where this transformers has none (nothing to skip)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        masking_utils.find_packed_sequence_indices = _skipping(original)
    return True


@contextlib.contextmanager
def own_positions(inputs: dict):
    """Forwards inside skip the search where ``inputs`` (the forward's keyword arguments) carry no positions."""
    if "position_ids" in inputs or not install():
        yield
        return
    before = getattr(_state, "own", False)
    _state.own = True
    try:
        yield
    finally:
        _state.own = before
