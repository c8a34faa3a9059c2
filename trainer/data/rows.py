"""Training rows as flat token arrays on disk, read memory-mapped: nothing proportional to the corpus in Python.

A row set is four files: ``ids`` (token ids), ``target`` (1 where the token is a label, 0 where the loss
ignores it: prompts, non-assistant turns, padding, the first token of a packed segment), ``pos`` (position
ids, restarting at every document) and ``offsets`` (row i is ``[offsets[i], offsets[i+1])``). Labels are the
ids where ``target`` is 1 and ``IGNORE`` elsewhere, as transformers' causal models expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

IGNORE = -100
PARTS = ("ids", "target", "pos")


@dataclass
class Sequence:
    """One training row: ids, labels, and position ids restarting at every document boundary."""

    input_ids: np.ndarray | list[int]
    labels: np.ndarray | list[int]
    position_ids: np.ndarray | list[int]


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def pos_dtype(max_length: int) -> np.dtype:
    return np.dtype(np.uint16) if max_length <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


class RowStore:
    """Rows of one split (``train`` or ``val``) in a cache folder; indexable like a list of ``Sequence``."""

    def __init__(self, folder: Path, split: str, dtypes: dict[str, str]):
        self.offsets = np.load(folder / f"{split}.offsets.npy", mmap_mode="r")
        self._parts = {}
        for part in PARTS:
            path = folder / f"{split}.{part}.bin"
            dtype = np.dtype(dtypes[part])
            # np.memmap refuses an empty file; an empty split is an empty array.
            self._parts[part] = (
                np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
            )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Sequence:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i = i % len(self)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self._parts["ids"][start:end].astype(np.int64)
        labels = np.where(self._parts["target"][start:end].astype(bool), ids, IGNORE)
        return Sequence(ids, labels, self._parts["pos"][start:end].astype(np.int64))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1]) if len(self.offsets) else 0


class RowWriter:
    """Appends rows' arrays to a split's files; ``close`` writes the offsets."""

    def __init__(self, folder: Path, split: str, dtypes: dict[str, np.dtype]):
        self.folder, self.split, self.dtypes = folder, split, dtypes
        self._files = {part: open(folder / f"{split}.{part}.bin", "wb") for part in PARTS}  # noqa: SIM115
        self._ends: list[np.ndarray] = []
        self.tokens = 0

    def write(self, ids: np.ndarray, target: np.ndarray, pos: np.ndarray, row_ends: np.ndarray) -> None:
        """Tokens appended to the stream, and where rows end in it (relative to this call's first token)."""
        for part, values in (("ids", ids), ("target", target), ("pos", pos)):
            values.astype(self.dtypes[part], copy=False).tofile(self._files[part])
        self._ends.append(np.asarray(row_ends, dtype=np.int64) + self.tokens)
        self.tokens += len(ids)

    def close(self) -> int:
        for handle in self._files.values():
            handle.close()
        ends = np.concatenate([np.zeros(1, np.int64), *self._ends])
        np.save(self.folder / f"{self.split}.offsets.npy", ends)
        return len(ends) - 1
