"""Documents to rows, streamed through numpy a batch at a time: split (or truncate) long documents, then
pack them into rows of exactly ``max_length`` or keep one piece per row.

The rows are exactly those of the list-based packer this replaced: documents are concatenated in order and
cut at row ends; every piece of a document that a row or a ``max_length`` boundary starts is a segment whose
position ids restart at 0 and whose first label is ignored, so no token is predicted across a boundary; the
last row is filled with padding that is masked out of the loss, its positions counting on from the row's last
segment (a padding segment restarting at 0 made that row's batch a packed one, with a block-diagonal mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.data.rows import RowWriter


@dataclass
class PackCounts:
    documents: int = 0
    would_lose: int = 0  # tokens past max_length (what truncation would drop)
    truncated: int = 0  # tokens truncation did drop


class Packer:
    def __init__(self, writer: RowWriter, max_length: int, packing: bool, truncate: bool, pad_id: int):
        self.writer, self.length, self.packing, self.truncate, self.pad_id = (
            writer, max_length, packing, truncate, pad_id,
        )  # fmt: skip
        self.counts = PackCounts()
        self.stream = 0  # tokens written so far (packing: the open row holds stream % length of them)
        self.last_pos = -1  # the open segment's last position id, carried across batches

    def add(self, ids: np.ndarray, target: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their concatenated ids/targets and their lengths, in order."""
        if not len(lengths):
            return
        L = self.length
        lengths = lengths.astype(np.int64)
        self.counts.documents += len(lengths)
        lost = np.maximum(lengths - L, 0)
        self.counts.would_lose += int(lost.sum())
        starts = np.cumsum(lengths) - lengths
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        if self.truncate:
            keep = within < L
            ids, target, within = ids[keep], target[keep], within[keep]
            self.counts.truncated += int(lost.sum())
        if not len(ids):
            return
        piece_start = within % L == 0
        target = target.astype(np.uint8)
        if not self.packing:
            row_ends = np.flatnonzero(np.append(piece_start[1:], True)) + 1
            self.writer.write(ids, target, within % L, row_ends)
            self.stream += len(ids)
            return
        local = np.arange(len(ids), dtype=np.int64)
        segment_start = piece_start | ((self.stream + local) % L == 0)
        target = np.where(segment_start, 0, target).astype(np.uint8)
        last_start = np.maximum.accumulate(np.where(segment_start, local, -1))
        pos = np.where(last_start >= 0, local - last_start, self.last_pos + 1 + local)
        row_ends = np.flatnonzero((self.stream + local + 1) % L == 0) + 1
        self.writer.write(ids, target, pos, row_ends)
        self.stream += len(ids)
        self.last_pos = int(pos[-1])

    def close(self) -> int:
        """Pad the open row (packing) and write the offsets; the number of rows."""
        fill = (-self.stream) % self.length if self.packing else 0
        if fill:
            self.writer.write(
                np.full(fill, self.pad_id, np.int64),
                np.zeros(fill, np.uint8),
                # positions count on from the open segment: padding is no document of its own, so a batch
                # holding this row stays plain (causal attention, no mask; never looking right, and the
                # padding's labels ignored, no real token's output changes)
                np.arange(self.last_pos + 1, self.last_pos + 1 + fill, dtype=np.int64),
                np.array([fill]),
            )
        return self.writer.close()  # RowWriter: the number of rows
