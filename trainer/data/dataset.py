"""Training data for the loop: prepared rows (``trainer.data.prepare``: cached, memory-mapped), their
order per epoch, and collating rows into a batch.

Nothing is silently truncated: documents longer than ``max_length`` are split into chunks (or, if the user
asks for truncation, the tokens it loses are counted and reported). Instruction records put only the
response into the loss, chat records only the assistant's turns.
"""

from __future__ import annotations

import numpy as np

from trainer.data.batches import collate, epoch_order
from trainer.data.prepare import DataReport, PreparedData, prepare_data
from trainer.data.records import DataError
from trainer.data.rows import IGNORE, Sequence

__all__ = [
    "IGNORE", "DataError", "DataReport", "PreparedData", "Sequence", "collate", "epoch_order", "prepare_data",
]  # fmt: skip


class _Rows:
    """A RowWriter in memory: the rows ``pack`` returns."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.ends: list[np.ndarray] = []
        self.tokens = 0

    def write(self, ids, target, pos, row_ends) -> None:
        self.parts.append((np.asarray(ids, np.int64), np.asarray(target) > 0, np.asarray(pos, np.int64)))
        self.ends.append(np.asarray(row_ends, np.int64) + self.tokens)
        self.tokens += len(ids)

    def close(self) -> list[Sequence]:
        ids, target, pos = (np.concatenate([p[k] for p in self.parts]) for k in range(3))
        bounds = np.concatenate([[0], *self.ends])
        return [
            Sequence(ids[a:b], np.where(target[a:b], ids[a:b], IGNORE), pos[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])
        ]


def pack(pieces: list[tuple[list[int], list[int]]], max_length: int, pad_id: int) -> list[Sequence]:
    """Pack documents given as (ids, labels) lists into rows, in memory, exactly as data preparation packs
    them (``trainer.data.packing``: a document longer than max_length is split at max_length first); for
    tests and benchmarks that build rows from token lists. A label is the document's id there, or IGNORE."""
    from trainer.data.packing import Packer

    rows = _Rows()
    packer = Packer(rows, max_length, packing=True, truncate=False, pad_id=pad_id)
    for ids, labels in pieces:  # one document a call: documents are pieces already (<= max_length or split)
        ids_arr = np.asarray(ids, dtype=np.int64)
        target = np.asarray(labels, dtype=np.int64) != IGNORE
        packer.add(ids_arr, target, np.array([len(ids_arr)]))
    if not pieces:
        return []
    return packer.close()
