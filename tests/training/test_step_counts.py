"""What every rank reads alike about a step (trainer/training/step_counts.py): its target and input tokens, its
router aux loss and whether any rank was asked to stop, reduced with the loss in one collective and read with it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import types

import pytest
import torch

from tests.helpers import REPO, wait_for
from tests.training.test_fsdp import (
    assert_same_losses,
    llama_config,
    losses,
    two_process_command,
    two_process_env,
)
from trainer import runfolder
from trainer.runfolder import iter_records
from trainer.training.figures import Figures
from trainer.training.signals import StopFlag, Stopped
from trainer.training.step_counts import StepCounts, reduce_with_loss


class Ranks:
    """``world`` ranks that all hold the same values: a sum over them is ``world`` times one rank's."""

    def __init__(self, world: int) -> None:
        self.num_processes, self.device, self.reduced = world, torch.device("cpu"), []

    def reduce(self, tensor, reduction):
        self.reduced.append(tensor.clone())
        return tensor * self.num_processes if reduction == "sum" else tensor


def result(world: int, has_aux: bool):
    """One rank's share of a step: 40 target tokens over all ranks, 30 input tokens and a loss sum of 12 here."""
    return types.SimpleNamespace(
        loss_sum=torch.tensor(12.0),
        targets=torch.tensor(40.0),
        target_count=40 if world == 1 else None,
        input_tokens=30,
        aux_total=torch.tensor(0.5),
        has_aux=has_aux,
    )


def read(accelerator, step, stop_asked: bool) -> tuple:
    loss, shared, counts = reduce_with_loss(accelerator, step, stop_asked)
    figures = Figures.behind(loss, torch.tensor(2.0), shared, lambda loss, norm: None, counts)
    assert figures.pending
    return figures.read()


@pytest.mark.parametrize("has_aux", [False, True])
def test_one_process_reads_its_counts_from_the_host_and_only_the_aux_loss_with_the_loss(has_aux):
    ranks = Ranks(1)
    loss, grad_norm, skipped, counts = read(ranks, result(1, has_aux), stop_asked=True)
    assert ranks.reduced == []  # nothing to agree on
    assert (loss, grad_norm, skipped) == (pytest.approx(0.3), 2.0, None)
    assert counts == StepCounts(40, 30, 0.5 if has_aux else None, True)


@pytest.mark.parametrize("has_aux", [False, True])
def test_several_processes_reduce_everything_they_share_in_the_one_collective_of_the_loss(has_aux):
    ranks = Ranks(2)
    loss, grad_norm, skipped, counts = read(ranks, result(2, has_aux), stop_asked=True)
    assert len(ranks.reduced) == 1  # loss, aux loss, input tokens and the stop flag: one all-reduce
    assert ranks.reduced[0].dtype == torch.float64  # token counts exact past float32's 2**24
    assert loss == pytest.approx(24 / 40)  # both ranks' loss sums over all target tokens
    assert counts == StepCounts(40, 60, 0.5 if has_aux else None, True)  # the aux loss: the ranks' mean
    _, _, _, counts = read(Ranks(2), result(2, has_aux), stop_asked=False)
    assert counts.stop is False


def test_big_token_counts_stay_exact():
    step = result(2, False)
    step.input_tokens, step.targets = 2**24 + 1, torch.tensor(float(2**25))
    *_, counts = read(Ranks(2), step, stop_asked=False)
    assert counts.input_tokens == 2**25 + 2


def test_a_rank_without_a_signal_stops_where_all_agreed_and_exits_as_if_terminated():
    flag = StopFlag()
    ranks = Ranks(2)
    assert not flag.requested(ranks, agreed=False) and flag.signum is None
    assert flag.requested(ranks, agreed=True) and flag.exit_code == 143
    assert ranks.reduced == []  # the agreed flag came with a step's loss: no collective of its own


def test_a_stop_agreed_by_an_evaluations_check_holds_against_a_flag_reduced_before_it():
    """A signal to another rank mid-evaluation: the batches' check agrees on it (a collective), and the loop's
    check after the step must stop too, though the flag reduced with the step's loss, before the signal, says no."""
    flag = StopFlag()
    other_rank_signalled = types.SimpleNamespace(
        num_processes=2, device=torch.device("cpu"), reduce=lambda tensor, reduction: torch.ones(())
    )
    with pytest.raises(Stopped):
        flag.check(other_rank_signalled)
    assert flag.requested(Ranks(2), agreed=False) and flag.exit_code == 143


def rank_processes(launcher) -> dict[int, object]:
    import psutil

    found = {}
    for process in psutil.Process(launcher.pid).children(recursive=True):
        rank = process.environ().get("RANK")
        if rank is not None and "--config" in process.cmdline():
            found[int(rank)] = process
    return found


@pytest.mark.slow
def test_two_ranks_reading_late_log_one_processs_losses_and_stop_together_on_one_ranks_signal(tmp_path):
    """Two gloo ranks with the fused AdamW (forced on the CPU, tests/fused_adamw_on_cpu.py), so each step's
    figures and counts are read after the next step's passes: the losses and token counts of one process. A
    SIGTERM to rank 1 alone reaches rank 0 through the stop flag reduced with a step's loss: both stop after
    the same step, one checkpoint is saved, and the same command resumes to one process's losses."""
    fused = [sys.executable, "-m", "tests.fused_adamw_on_cpu", "train", "--config"]
    shape = {"training": {"max_steps": 30, "save_steps": 100}, "eval": {"interval": 100}}
    one_cfg, one = llama_config(tmp_path, "one", shape)
    single = subprocess.run([*fused, str(one_cfg)], cwd=REPO, env=two_process_env(), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]

    two_cfg, two = llama_config(tmp_path, "two", shape)
    command = two_process_command(two_cfg, "tests.fused_adamw_on_cpu")
    proc = subprocess.Popen(command, cwd=REPO, env=two_process_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert wait_for(lambda: len(losses(two)) >= 2 or proc.poll() is not None)
    ranks = rank_processes(proc)
    assert sorted(ranks) == [0, 1]
    ranks[1].send_signal(signal.SIGTERM)
    proc.wait(timeout=300)

    info = json.loads((two / "run.json").read_text())
    assert info["status"] == "interrupted" and 2 <= info["step"] < 30
    events = list(iter_records(two / "logs" / runfolder.EVENTS_LOG))
    assert [(e["signal"], e["step"]) for e in events if e["event"] == "signal"] == [("SIGTERM", info["step"])]
    saved = [(e["kind"], e["step"]) for e in events if e["event"] == "checkpoint_saved"]
    assert saved == [("signal", info["step"])]  # both ranks saved the one step they agreed on

    resumed = subprocess.run(command, cwd=REPO, env=two_process_env(), capture_output=True, text=True,
                             timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_losses(losses(two), losses(one))
    records = {r["step"]: r for r in iter_records(two / "logs" / runfolder.TRAINING_LOG)}
    reference = {r["step"]: r for r in iter_records(one / "logs" / runfolder.TRAINING_LOG)}
    assert sorted(records) == list(range(1, 31))
    for step, record in records.items():
        assert record["tokens"] == reference[step]["tokens"]  # all ranks' target tokens, read with the loss
        assert record["tokens_per_sec"] > 0
