"""Stall detection must not mistake a long evaluation (no training records) for a stalled run."""

from __future__ import annotations

from dashboard.runs import StallPolicy, assess

POLICY = StallPolicy(factor=10.0, min_seconds=60.0, startup_seconds=900.0)
TRAIN_TS = [1000.0 + i for i in range(20)]  # one record per second, last at 1019


def test_quiet_run_is_stalled():
    events = [{"event": "run_start", "ts": 999.0}]
    status, why = assess({"status": "running"}, events, [], TRAIN_TS, 1019.0, 1019.0 + 120, POLICY)
    assert status == "stalled" and why == "no new step for 2 min (usually one every 1 s)"


def test_quiet_run_during_evaluation_is_running():
    events = [{"event": "run_start", "ts": 999.0}, {"event": "eval_start", "ts": 1019.5, "step": 20}]
    status, why = assess({"status": "running"}, events, [], TRAIN_TS, 1019.5, 1019.5 + 300, POLICY)
    assert (status, why) == ("running", "evaluating")
    late = assess({"status": "running"}, events, [], TRAIN_TS, 1019.5, 1019.5 + 1000, POLICY)
    assert late[0] == "stalled"  # an evaluation hung for longer than the start-up allowance


def test_finished_evaluation_no_longer_excuses_silence():
    events = [{"event": "eval_start", "ts": 1010.0}, {"event": "eval_done", "ts": 1011.0}]
    status, _ = assess({"status": "running"}, events, [], TRAIN_TS, 1019.0, 1019.0 + 120, POLICY)
    assert status == "stalled"
