"""SIGTERM/SIGINT anywhere in a run: at once during set-up, at agreed checks between evaluation and generation
batches (every rank as often), and after the step otherwise. The whole run under SIGTERM mid-evaluation is
``test_resume.py::test_sigterm_during_a_long_evaluation_saves_its_step_and_resumes_exactly``."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from trainer.config import load_config
from trainer.training import evaluation, signals
from trainer.training.signals import StopFlag, Stopped


@pytest.fixture
def flag():
    stop = StopFlag().install()
    yield stop
    stop.restore()


def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # Python runs the handler between bytecodes, right after the signal arrives


def test_during_set_up_a_signal_stops_at_once(flag):
    with pytest.raises(Stopped, match="SIGTERM"):
        sigterm()
    assert flag.exit_code == 143 and signals.should_stop()


def test_deferred_work_polls_should_stop_and_stops_when_it_leaves(flag):
    pieces = 0
    with pytest.raises(Stopped):
        with signals.deferred():
            for _ in range(5):
                if signals.should_stop():
                    break
                pieces += 1
                if pieces == 2:
                    sigterm()  # lands in the middle: no exception here, the loop sees it at its next poll
    assert pieces == 2


def test_once_the_run_is_open_a_signal_waits_for_the_next_check(flag):
    flag.immediate = False
    sigterm()  # no exception: the step (or evaluation batch) in progress finishes
    accelerator = SimpleNamespace(num_processes=1)
    assert flag.requested(accelerator)
    with pytest.raises(Stopped):
        flag.check(accelerator)


def test_a_forked_worker_still_ends_on_sigterm(flag):
    """Data preparation's pool workers fork from the run and inherit its handler; they must die as before."""
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            os._exit(1)  # never reaches pytest's code in the child
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert not signals.should_stop()  # and the run itself got nothing


def test_without_a_run_nothing_is_installed_or_changed():
    before = signal.getsignal(signal.SIGTERM)
    assert not signals.should_stop()
    with signals.deferred():  # nothing to defer
        pass
    stop = StopFlag().install()
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before and not signals.should_stop()


class FakeRank:
    """An accelerator as one rank of ``world`` sees it (the sums across ranks are not the point here)."""

    def __init__(self, rank: int, world: int):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self.distributed_type, self.is_main_process = "NO", rank == 0

    def reduce(self, tensor, op):
        return tensor

    def unwrap_model(self, model):
        return model


def tiny_loss(model, batch, accelerator):
    return torch.tensor(1.0), None


@pytest.fixture
def rows_as_batches(monkeypatch):
    """Validation rows stand for themselves: the data layer's row type is not what these tests are about."""
    monkeypatch.setattr(evaluation, "collate", lambda rows, pad_id: rows)
    monkeypatch.setattr(evaluation, "count_targets", lambda batch: len(batch))


def counting_check(limit: int | None = None):
    calls = []

    def check():
        calls.append(1)
        if limit is not None and len(calls) >= limit:
            raise Stopped(signal.SIGTERM)

    return check, calls


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_checks_before_every_batch_as_often_on_every_rank(write_config, world, rows_as_batches):
    """5 batches over 2 ranks is 3 and 2 forwards: both ranks check 3 times, or a collective would hang."""
    cfg = load_config(write_config({"eval": {"batch_size": 2, "max_batches": 0}}))
    val = list(range(10))
    model = torch.nn.Linear(1, 1)
    counts = []
    for rank in range(world):
        check, calls = counting_check()
        evaluation.evaluate_loss(model, val, cfg, FakeRank(rank, world), 0, tiny_loss, check)
        counts.append(len(calls))
    assert counts == [-(-5 // world)] * world


def test_a_stop_mid_evaluation_leaves_the_model_as_it_was(write_config, rows_as_batches):
    cfg = load_config(write_config({"eval": {"batch_size": 1, "max_batches": 0}}))
    model = torch.nn.Linear(1, 1).train()
    check, calls = counting_check(limit=3)
    with pytest.raises(Stopped):
        evaluation.evaluate_loss(model, list(range(50)), cfg, FakeRank(0, 1), 0, tiny_loss, check)
    assert len(calls) == 3 and model.training


def test_generation_and_scoring_check_as_often_on_every_rank(write_config, tmp_path, monkeypatch):
    """5 examples over 2 ranks, 2 prompts a batch: rank 0 generates 2 batches, rank 1 one (and makes up the
    other's check). Then every rank scores all 5 predictions, checking before each (the SQL may be slow)."""
    from transformers import AutoTokenizer

    from tests.helpers import REPO
    from tests.tasks.test_generation import tiny_model
    from trainer.tasks import get_task
    from trainer.tasks.sql_example import write_example_spider
    from trainer.training import task_eval

    task = get_task("spider", write_example_spider(tmp_path / "spider"), timeout_s=1.0)
    examples = task.load("validation")[:5]
    overrides = {"generation_batch_size": 2, "max_new_tokens": 2, "max_total_length": 32}
    cfg = load_config(write_config({"eval": overrides}))
    model, tokenizer = tiny_model(), AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-llama")
    # What gather_object returns on every rank: all predictions, in order.
    monkeypatch.setattr("accelerate.utils.gather_object", lambda pairs: [(i, " SELECT 1") for i in range(5)])
    for rank in (0, 1):
        check, calls = counting_check()
        result = task_eval.evaluate_generation(
            model, tokenizer, task, examples, cfg, FakeRank(rank, 2), check
        )
        assert result["metrics"]["n"] == 5
        assert len(calls) == 2 + 5, rank
    with pytest.raises(Stopped):  # a check that raises ends it there
        task_eval.evaluate_generation(
            model, tokenizer, task, examples, cfg, FakeRank(1, 2), counting_check(2)[0]
        )


def test_a_signal_during_set_up_ends_the_run_with_its_exit_code_and_nothing_saved(
    write_config, tmp_path, monkeypatch, capsys
):
    """Loading a large model takes minutes and cannot poll; the handler stops it where it is."""
    from trainer.training import loop

    def slow_set_up(*args, **kwargs):
        sigterm()
        time.sleep(60)  # a long load that would outlast the scheduler's grace period
        raise AssertionError("set-up went on after SIGTERM")

    monkeypatch.setattr(loop, "set_up", slow_set_up)
    previous = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    assert loop.train(load_config(write_config())) == 143
    assert time.monotonic() - start < 30
    assert "stopped by SIGTERM during set-up; nothing to save" in capsys.readouterr().out
    assert not any((tmp_path / "run").glob("checkpoint-*"))
    assert signal.getsignal(signal.SIGTERM) is previous and not signals.should_stop()
