"""From rows to batches: the row order of each epoch, the rows of each optimizer step, how they are split into
micro-batches across processes, collated into tensors, and how many of their tokens carry the loss.

A pure function of (seed, epoch, position) throughout, so a resume replays exactly the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.rows import IGNORE, Sequence


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


@dataclass
class Position:
    """Where the loop is in the data: epoch and rows consumed within it (global, all ranks)."""

    epoch: int = 0
    row: int = 0


@dataclass(frozen=True)
class StepShape:
    """How one optimizer step's rows are fed: micro-batch size, accumulation, optional row split length."""

    micro: int
    accum: int
    split_length: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def next_step_rows(
    train_rows: int, rows_per_step: int, seed: int, pos: Position
) -> tuple[list[int], Position]:
    """Row ids for the next optimizer step; a partial remainder at an epoch's end is dropped."""
    if pos.row + rows_per_step > train_rows:
        pos = Position(pos.epoch + 1, 0)
    order = epoch_order(train_rows, seed, pos.epoch)
    return order[pos.row : pos.row + rows_per_step].tolist(), Position(pos.epoch, pos.row + rows_per_step)


def split_rows(rows: list[Sequence], length: int | None) -> list[Sequence]:
    """Cut each row into pieces of at most ``length`` tokens; every token stays in some piece."""
    if length is None:
        return rows
    pieces = []
    for row in rows:
        for start in range(0, len(row.input_ids), length):
            end = start + length
            pieces.append(
                Sequence(row.input_ids[start:end], row.labels[start:end], row.position_ids[start:end])
            )
    return pieces


def micro_batches(
    rows: list[int], data: list[Sequence], shape: StepShape, world: int, rank: int, pad_id: int
) -> list[dict]:
    """This rank's micro-batches of one optimizer step: micro-batch k of rank r takes the k*world+r-th slice.

    After an OOM at micro-batch 1, rows are split into shorter pieces, fed one piece per micro-batch."""
    slices = [rows[i : i + shape.micro] for i in range(0, len(rows), shape.micro)]
    mine = [[data[j] for j in s] for s in slices[rank::world]]
    if shape.split_length is not None:
        mine = [[piece] for group in mine for piece in split_rows(group, shape.split_length)]
    return [collate(group, pad_id) for group in mine]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, queued without the host waiting: a host tensor bound for a GPU is pinned first
    (``pinned_for``). CUDA copies pageable memory through a driver staging buffer on the host's time; a pinned
    one is queued as a DMA on the stream, and the host goes on launching."""
    if pinned_for(tensor, device):
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def pinned_for(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` must be pinned before its copy to ``device``: a host tensor, not yet pinned, bound
    for a GPU."""
    return torch.device(device).type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned()


def pin_batch(batch: dict, device: torch.device) -> dict:
    """A collated batch in pinned memory where it is bound for a GPU, so its copies later queue at once."""
    return {k: v.pin_memory() if pinned_for(v, device) else v for k, v in batch.items()}


def count_targets(batch: dict) -> int:
    """Tokens that carry a next-token label (prompt and padding excluded): the loss's denominator."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
