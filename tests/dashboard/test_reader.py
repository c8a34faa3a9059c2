"""The incremental reader and the columnar stores: what survives odd logs, and what it costs."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from tests.dashboard.fixtures import append, train_record
from trainer import runfolder
from trainer.runfolder.columns import StepTable
from trainer.runfolder.reader import LogTail, parse_lines, tail_records
from trainer.runfolder.rundata import RunData
from trainer.runfolder.series import downsample_indices, ema, ema_reference, last_ema, moving_average


def read_all(tail: LogTail) -> list[dict]:
    tail.check_replaced()
    return [record for batch in tail.read_new() for record in batch]


def test_tail_reads_only_appended_bytes(tmp_path: Path):
    log = tmp_path / "training_log.jsonl"
    append(log, [train_record(s, 100.0 + s, 1.0) for s in range(1, 4)])
    tail = LogTail(log, tmp_path)
    assert [r["step"] for r in read_all(tail)] == [1, 2, 3]
    assert tail.offset == log.stat().st_size
    assert read_all(tail) == []
    append(log, [train_record(4, 104.0, 1.0)])
    assert [r["step"] for r in read_all(tail)] == [4]


def test_half_written_line_waits_until_finished(tmp_path: Path):
    log = tmp_path / "training_log.jsonl"
    line = runfolder.encode_record(train_record(2, 102.0, 1.5)).encode()
    append(log, [train_record(1, 101.0, 1.0)], raw_tail=line[:17])
    tail = LogTail(log, tmp_path)
    assert [r["step"] for r in read_all(tail)] == [1]
    with open(log, "ab") as handle:
        handle.write(line[17:])
    assert [r["loss"] for r in read_all(tail)] == [1.5]
    assert tail.bad_lines == 0


def test_garbage_lines_are_counted_and_skipped():
    records, bad = parse_lines([b'{"a": 1}', b"not json", b"[1, 2]", b"", b"\xff", b'{"b": 2}', b"[" * 50000])
    assert records == [{"a": 1}, {"b": 2}]
    assert bad == 4  # a blank line is not garbage


def test_batch_parse_does_not_merge_lines():
    # "1, 2" parses inside a JSON array as two values: the fast path must notice and fall back.
    records, bad = parse_lines([b'{"a": 1}', b"1, 2"])
    assert records == [{"a": 1}] and bad == 1


def test_missing_and_empty_files(tmp_path: Path):
    tail = LogTail(tmp_path / "nope.jsonl", tmp_path)
    assert read_all(tail) == []
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read_all(LogTail(tmp_path / "empty.jsonl", tmp_path)) == []


def test_truncated_or_replaced_file_starts_over(tmp_path: Path):
    log = tmp_path / "training_log.jsonl"
    append(log, [train_record(s, float(s), 1.0) for s in range(1, 6)])
    tail = LogTail(log, tmp_path)
    read_all(tail)
    log.unlink()
    append(log, [train_record(1, 1.0, 9.0)])
    assert tail.check_replaced() is True
    assert [r["loss"] for batch in tail.read_new() for r in batch] == [9.0]


def test_large_log_is_read_in_chunks(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("trainer.runfolder.reader.CHUNK_BYTES", 1000)
    log = tmp_path / "training_log.jsonl"
    append(log, [train_record(s, float(s), 1.0) for s in range(1, 301)])
    tail = LogTail(log, tmp_path)
    batches = (tail.check_replaced(), list(tail.read_new()))[1]
    assert len(batches) > 10
    assert [r["step"] for b in batches for r in b] == list(range(1, 301))


def test_tail_records_reads_only_the_end(tmp_path: Path):
    log = tmp_path / "training_log.jsonl"
    append(log, [train_record(s, float(s), 1.0) for s in range(1, 2001)], raw_tail=b'{"half')
    last = tail_records(log, tmp_path, nbytes=4096)
    assert 5 < len(last) < 40
    assert last[-1]["step"] == 2000
    assert [r["step"] for r in last] == list(range(2001 - len(last), 2001))


def test_step_table_last_record_per_step_wins():
    table = StepTable()
    for step, loss in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (5, 5.0), (4, 4.0)]:
        table.add({"step": step, "loss": loss, "ts": float(step)})
    assert list(table.steps) == [1, 2, 3, 4, 5]
    assert list(table.columns["loss"]) == [1.0, 20.0, 30.0, 4.0, 5.0]
    # Same answer as the contract's own reference reader.
    records = [
        {"step": s, "loss": v}
        for s, v in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (5, 5.0), (4, 4.0)]
    ]
    assert [r["loss"] for r in runfolder.last_per_step(records)] == list(table.columns["loss"])


def test_step_table_unknown_fields_nulls_and_text():
    table = StepTable()
    table.add({"step": 1, "loss": 1.0})
    table.add(
        {"step": 2, "loss": None, "nonfinite": ["loss"], "new_metric": 7, "note": "text", "nested": {"a": 1}}
    )
    table.add({"step": "3", "loss": 1.0})  # not a step: rejected
    assert table.add({"step": True}) is False
    assert list(table.steps) == [1, 2]
    assert math.isnan(table.columns["loss"][1])
    assert math.isnan(table.columns["new_metric"][0]) and table.columns["new_metric"][1] == 7.0
    assert "note" not in table.columns and "nested" not in table.columns and "nonfinite" not in table.columns


def test_run_data_resume_replay_and_current_position(tmp_path: Path):
    run = tmp_path / "run"
    log = run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    append(log, [train_record(s, float(s), 1.0) for s in range(1, 11)])
    append(log, [train_record(s, 20.0 + s, 2.0) for s in range(6, 8)])  # resumed from step 5
    data = RunData("run", run, tmp_path)
    data.refresh()
    assert data.train.table.rows == 10
    assert list(data.train.table.columns["loss"]) == [1.0] * 5 + [2.0, 2.0] + [1.0] * 3
    assert data.train.latest["step"] == 7  # where the trainer is now, not the highest step ever logged
    version = data.train.version
    data.refresh()
    assert data.train.version == version  # nothing appended, nothing changed


def test_run_data_keeps_parsed_numbers_compact(tmp_path: Path):
    run = tmp_path / "run"
    append(
        run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG,
        [train_record(s, float(s), 1.0) for s in range(1, 5001)],
    )
    data = RunData("run", run, tmp_path)
    data.refresh()
    table = data.train.table
    assert all(column.typecode == "d" and len(column) == 5000 for column in table.columns.values())
    assert table.steps.typecode == "q"


def test_symlinked_log_leaving_the_root_is_not_read(tmp_path: Path):
    outside = tmp_path / "outside.jsonl"
    append(outside, [train_record(1, 1.0, 9.0)])
    root = tmp_path / "root"
    (root / "run" / runfolder.LOGS_DIR).mkdir(parents=True)
    os.symlink(outside, root / "run" / runfolder.LOGS_DIR / runfolder.TRAINING_LOG)
    data = RunData("run", root / "run", root)
    data.refresh()
    assert data.train.table.rows == 0


# ---------------------------------------------------------------- series


def test_ema_matches_tensorboard_reference():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 1.0, 50_000)
    values[::37] = np.nan
    values[5] = np.inf
    for weight in (0.0, 0.3, 0.6, 0.9, 0.99, 0.999):
        fast = ema(values, weight)
        slow = np.array(ema_reference(values.tolist(), weight))
        finite = np.isfinite(slow)
        assert np.array_equal(np.isfinite(fast), finite)
        assert np.allclose(fast[finite], slow[finite], rtol=1e-9, atol=1e-12)
    assert ema([1.0, 2.0], 0.6).tolist() == [1.0, 1.625]  # bias-corrected: starts at the first value


def test_last_ema_equals_full_ema():
    values = list(np.linspace(5.0, 1.0, 3000))
    values[-3] = math.nan
    assert last_ema(values) == pytest.approx(float(ema(values)[-1]), rel=1e-12)
    assert last_ema([math.nan]) is None


def test_moving_average_skips_nonfinite():
    assert moving_average([1.0, 3.0, math.nan, 5.0], 2)[[0, 1, 3]].tolist() == [1.0, 2.0, 4.0]
    values = np.random.default_rng(1).random(500)
    expected = [values[max(0, i - 9) : i + 1].mean() for i in range(500)]
    assert np.allclose(moving_average(values, 10), expected)


def test_downsampling_keeps_first_last_and_spikes():
    values = np.ones(100_000)
    values[54_321] = 50.0
    values[77_777] = -50.0
    keep = downsample_indices(values, 500)
    assert len(keep) <= 500
    assert keep[0] == 0 and keep[-1] == len(values) - 1
    assert 54_321 in keep and 77_777 in keep
    assert list(downsample_indices(np.ones(10), 500)) == list(range(10))
    assert list(downsample_indices(np.ones(10), 0)) == list(range(10))
