"""What every rank must read alike about a step, reduced with its loss in one collective.

A step's record needs the target and input tokens of all ranks (and a MoE model's router aux loss), and every
rank must agree whether to stop after it (a signal may reach one rank only). Each was a collective of its own,
and reading each a sync that drained the GPU's queue. Here they ride in the one all-reduce the loss needs, and
reach the host with the loss (``figures.py``): with several processes a step has no other sync, and its
figures can be read a step late as in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCounts:
    """What a step's record and the stop decision need that all ranks share, the same on every rank."""

    targets: int  # target tokens of the step, all ranks
    input_tokens: int  # non-padding input tokens of the step, all ranks
    aux_loss: float | None  # the router aux loss, averaged over ranks (None: the model has none)
    stop: bool  # some rank had been asked to stop (a signal) when this step's update was queued


CountsRule = Callable[[list[float]], StepCounts]  # the shared values as read on the host -> StepCounts


def reduce_with_loss(
    accelerator, result, stop_asked: bool
) -> tuple[torch.Tensor, torch.Tensor | None, CountsRule]:
    """The step's mean loss (all ranks), the device values to read along with it, and how they read as
    ``StepCounts``. One process has its counts on the host already; only an aux loss is read with the loss."""
    world = accelerator.num_processes
    if world == 1:
        shared = result.aux_total.reshape(1) if result.has_aux else None

        def counts(read: list[float]) -> StepCounts:
            aux = read[0] if result.has_aux else None
            return StepCounts(result.target_count, result.input_tokens, aux, stop_asked)

        return result.loss_sum / result.targets, shared, counts
    device = result.loss_sum.device
    # float64: token counts stay exact past float32's 2**24, and the loss sums as precisely as they do.
    host = torch.tensor([float(result.input_tokens), 1.0 if stop_asked else 0.0], dtype=torch.float64)
    local = torch.cat([
        result.loss_sum.detach().double().reshape(1),
        result.aux_total.detach().double().reshape(1),
        host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host,
    ])  # fmt: skip
    total = accelerator.reduce(local, "sum")
    shared = torch.stack([total[1] / world, result.targets.double(), total[2], total[3]])

    def counts(read: list[float]) -> StepCounts:
        aux, targets, tokens, stop = read
        return StepCounts(round(targets), round(tokens), aux if result.has_aux else None, stop > 0)

    return total[0] / result.targets, shared, counts
