"""Training data for the loop: prepared rows (``trainer.data.prepare``: cached, memory-mapped), their
order per epoch, and collating rows into a batch.

Nothing is silently truncated: documents longer than ``max_length`` are split into chunks (or, if the user
asks for truncation, the tokens it loses are counted and reported). Instruction records put only the
response into the loss, chat records only the assistant's turns.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

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


def _long(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64))


def collate(rows: list[Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; an attention mask only when there is padding to hide."""
    width = max(len(r.input_ids) for r in rows)
    needs_mask = any(len(r.input_ids) < width for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
        "token_mask": torch.zeros((len(rows), width), dtype=torch.bool),
    }
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        batch["input_ids"][i, :n] = _long(row.input_ids)
        batch["labels"][i, :n] = _long(row.labels)
        batch["position_ids"][i, :n] = _long(row.position_ids)
        batch["token_mask"][i, :n] = True
    if needs_mask:
        batch["attention_mask"] = batch["token_mask"].long()
    return batch


@functools.lru_cache(maxsize=2)
def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order for one epoch; a pure function of (seed, epoch) so a resume can replay it. Kept as one
    array per epoch (8 bytes a row), since every step reads a slice of it."""
    generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = torch.randperm(num_rows, generator=generator).numpy()
    order.flags.writeable = False
    return order
