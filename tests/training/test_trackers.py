"""``logging.report_to``: metrics reach accelerate's trackers (TensorBoard here, offline) beside the JSONL logs."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import TINY, run_trainer
from trainer import runfolder

# The test trains a run and compares its TensorBoard events with its logs.
pytestmark = pytest.mark.slow


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in every TensorBoard event file under the run folder, by tag."""
    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(run_dir.rglob("events.out.tfevents.*")):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return found


def test_tensorboard_gets_the_same_numbers_and_jsonl_stays_complete(write_config):
    config = write_config()
    result = run_trainer("train", "--config", str(config), "--set", "logging.report_to=[tensorboard]")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = config.parent / "run"
    logs = run / runfolder.LOGS_DIR
    total = TINY["training"]["max_steps"]

    # The JSONL logs are all there, as without trackers.
    train = list(runfolder.iter_records(logs / runfolder.TRAINING_LOG))
    assert [r["step"] for r in train] == list(range(1, total + 1))
    for record in train:
        assert all(field in record for field in runfolder.REQUIRED_FIELDS[runfolder.TRAINING_LOG])
    evals = list(runfolder.iter_records(logs / runfolder.EVAL_LOG))
    assert [r["step"] for r in evals] == list(
        range(TINY["eval"]["interval"], total + 1, TINY["eval"]["interval"])
    )
    events = [e["event"] for e in runfolder.iter_records(logs / runfolder.EVENTS_LOG)]
    assert events[0] == "run_start" and events[-1] == "run_end"
    assert runfolder.read_run_json(run)["status"] == "finished"

    # Tracker files live in the run folder's trackers/ (documented in docs/run-folder.md).
    assert list((run / "trackers").rglob("events.out.tfevents.*"))

    # TensorBoard holds the same values (stored as float32).
    tb = scalars(run)
    assert [s for s, _ in tb["train/loss"]] == [r["step"] for r in train]
    for (step, value), record in zip(tb["train/loss"], train):
        assert math.isclose(value, record["loss"], rel_tol=1e-6), (step, value, record["loss"])
    for (_, value), record in zip(tb["train/lr"], train):
        assert math.isclose(value, record["lr"], rel_tol=1e-6, abs_tol=1e-12)
    for (_, value), record in zip(tb["train/grad_norm"], train):
        assert math.isclose(value, record["grad_norm"], rel_tol=1e-6)
    assert [(s, round(v, 5)) for s, v in tb["eval/loss"]] == [
        (r["step"], round(r["eval_loss"], 5)) for r in evals
    ]
