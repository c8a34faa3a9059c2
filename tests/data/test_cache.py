"""The tokenized-data cache: its rows are the list-based loader's (tests/data/reference_rows.py), it is built
once and reused, any change to the data, the settings or the tokenizer gets a new one, every source kind
gives the rows of the same records as JSONL, chat records learn their assistant turns only, and the
``cache`` and ``preprocess`` commands list, clear, build and reuse it."""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np
import pyarrow as pa
import pytest
import yaml

from tests.data import reference_rows
from tests.helpers import REPO, TINY, deep_merge, run_trainer
from trainer.cli import main
from trainer.config import Config, DataConfig, ModelConfig, PathsConfig
from trainer.data import cache
from trainer.data.chat import encode_chat, find_messages
from trainer.data.dataset import IGNORE, DataError, pack, prepare_data

CORPUS = REPO / "data" / "tiny_corpus.jsonl"
INSTRUCTIONS = REPO / "data" / "tiny_instructions.jsonl"
CHAT = REPO / "data" / "tiny_chat.jsonl"
# What a report says about the rows; the rest (cache, fingerprint, cache_hit, timings) is about the cache.
REPORT_FIELDS = (
    "train_records", "val_records", "train_sequences", "val_sequences", "skipped_lines", "skipped_examples",
    "truncation_would_lose_tokens", "truncated_tokens", "format", "packing",
)  # fmt: skip


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """What ``datasets`` keeps of the files it reads (and its locks) stays in the test's folder, not ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.model.loading import load_tokenizer

    return load_tokenizer(Config(model=ModelConfig(name_or_path=str(REPO / "configs" / "tiny-moe"))))


def prepare(folder, tokenizer, train=CORPUS, val=None, family_packing=True, workers=1, **data):
    """``prepare_data`` into the cache folder ``folder / "cache"``."""
    cfg = DataConfig(**{"cache_dir": str(folder / "cache"), **data})
    paths = PathsConfig(train_file=str(train), val_file=str(val) if val else None)
    return prepare_data(paths, cfg, tokenizer, family_packing, workers, log=lambda *a, **k: None)


def rows(store) -> list[tuple[list[int], list[int], list[int]]]:
    return [
        (list(map(int, r.input_ids)), list(map(int, r.labels)), list(map(int, r.position_ids))) for r in store
    ]


def facts(report) -> dict:
    return {key: getattr(report, key) for key in REPORT_FIELDS}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def corpus_lines(n: int | None = None) -> list[str]:
    return CORPUS.read_text().splitlines()[:n]


# ---------------------------------------------------------------- rows equal the list-based loader's


def bad_corpus(tmp_path):
    """The tiny corpus with a bad line first, bad lines and a bad record inside, a blank and a CRLF line."""
    lines = corpus_lines()
    lines[10] = lines[10] + "\r"
    lines[20:20] = ["{not json", "", '["a list"]']
    lines[100:100] = ['{"text": 7}']
    lines[0:0] = ["nonsense"]
    return write_lines(tmp_path / "bad.jsonl", lines)


CASES = {
    "text, packed, default max_length": dict(),
    "text, packed": dict(max_length=64),
    "text, unpacked": dict(max_length=64, packing=False),
    "text, packed, truncated": dict(max_length=64, long_documents="truncate"),
    "text, unpacked, truncated": dict(max_length=64, packing=False, long_documents="truncate"),
    "text, family without packing": dict(max_length=64, family_packing=False),
    "text, no eos, other seed and split": dict(max_length=64, add_eos=False, seed=3, val_fraction=0.2),
    "instruction, packed": dict(train=INSTRUCTIONS, max_length=64),
    "instruction, unpacked": dict(train=INSTRUCTIONS, packing=False),
    "instruction, unpacked, truncated": dict(
        train=INSTRUCTIONS, packing=False, max_length=16, long_documents="truncate"
    ),
    "val_file": dict(max_length=64, val="val"),
    "bad lines": dict(max_length=64, train="bad"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_and_report_equal_the_list_based_loaders(tmp_path, tokenizer, case):
    given = dict(CASES[case])
    if given.get("val") == "val":
        given["val"] = write_lines(tmp_path / "val.jsonl", corpus_lines(300)[200:] + ["{not json"])
    if given.get("train") == "bad":
        given["train"] = bad_corpus(tmp_path)
    new = prepare(tmp_path, tokenizer, **given)
    family_packing = given.pop("family_packing", True)
    val = given.pop("val", None)
    paths = PathsConfig(train_file=str(given.pop("train", CORPUS)), val_file=str(val) if val else None)
    old = reference_rows.prepare_data(paths, DataConfig(**given), tokenizer, family_packing)
    assert not new.report.cache_hit
    assert rows(new.train) == rows(old.train) and len(new.train) > 0
    assert rows(new.val) == rows(old.val)
    expected = facts(old.report)
    if case == "bad lines":
        # The list-based loader counted a record it could not tokenize without naming it; now it is named.
        bad = paths.train_file
        assert expected["skipped_examples"] == [
            f"{bad}:1: not valid JSON (Expecting value)",
            f"{bad}:22: not valid JSON (Expecting property name enclosed in double quotes)",
            f"{bad}:24: expected a JSON object",
        ]
        expected["skipped_examples"].append(f"{bad}:102: field 'text' must be a string")
        assert expected["skipped_lines"] == 4
    assert facts(new.report) == expected
    padding = new.train.tokens - new.report.train_tokens  # what fills the last packed row
    assert 0 <= padding < len(new.train[-1].input_ids)


# ---------------------------------------------------------------- built once, reused


def test_a_second_prepare_and_a_new_run_folder_reuse_the_cache(tmp_path, tokenizer):
    first = prepare(tmp_path, tokenizer, max_length=64)
    again = prepare(tmp_path, tokenizer, max_length=64)
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), max_length=64)
    other_run = prepare_data(
        PathsConfig(output_dir=str(tmp_path / "another-run"), train_file=str(CORPUS)), cfg, tokenizer, True, 2
    )
    assert not first.report.cache_hit and again.report.cache_hit and other_run.report.cache_hit
    assert first.report.fingerprint == again.report.fingerprint == other_run.report.fingerprint
    assert first.report.cache == again.report.cache == str(tmp_path / "cache" / first.report.fingerprint)
    assert again.report.prepare_seconds < 5 and other_run.report.prepare_seconds < 5
    assert rows(again.train) == rows(first.train) and rows(other_run.val) == rows(first.val)
    assert facts(again.report) == facts(first.report)
    assert again.length_report == first.length_report and first.length_report["records_analyzed"] > 0
    assert [e["fingerprint"] for e in cache.entries(tmp_path / "cache")] == [first.report.fingerprint]


# ---------------------------------------------------------------- a change gets a new cache, never a stale one


def test_changed_file_content_of_the_same_size_and_name_gets_a_new_cache(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", corpus_lines(200))
    before = prepare(tmp_path, tokenizer, train=path, max_length=64)
    text = path.read_text()
    changed = text.replace("Ada", "Eve", 1)
    assert changed != text and len(changed.encode()) == len(text.encode())
    path.write_text(changed)
    after = prepare(tmp_path, tokenizer, train=path, max_length=64)
    assert not after.report.cache_hit and after.report.fingerprint != before.report.fingerprint
    assert rows(after.train) != rows(before.train)

    # Rewritten again, its modification time set back to what it was: still noticed.
    stat = path.stat()
    path.write_text(changed.replace("Eve", "Bob", 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    last = prepare(tmp_path, tokenizer, train=path, max_length=64)
    assert not last.report.cache_hit
    assert last.report.fingerprint not in (before.report.fingerprint, after.report.fingerprint)
    old = reference_rows.prepare_data(
        PathsConfig(train_file=str(path)), DataConfig(max_length=64), tokenizer, True
    )
    assert rows(last.train) == rows(old.train)


@pytest.mark.parametrize(
    "change", [{"max_length": 128}, {"add_eos": False}, {"val_fraction": 0.1}, {"packing": False}]
)
def test_changed_setting_gets_a_new_cache(tmp_path, tokenizer, change):
    path = write_lines(tmp_path / "d.jsonl", corpus_lines(100))
    base = prepare(tmp_path, tokenizer, train=path, max_length=64)
    changed = prepare(tmp_path, tokenizer, train=path, **{"max_length": 64, **change})
    assert not changed.report.cache_hit and changed.report.fingerprint != base.report.fingerprint
    # Settings that change no row share the cache.
    same = prepare(tmp_path, tokenizer, train=path, max_length=64, on_bad_line="fail", workers=2)
    assert same.report.cache_hit and same.report.fingerprint == base.report.fingerprint


def test_another_tokenizer_gets_a_new_cache(tmp_path, tokenizer):
    import copy

    path = write_lines(tmp_path / "d.jsonl", corpus_lines(100))
    base = prepare(tmp_path, tokenizer, train=path, max_length=64)
    more_words = copy.deepcopy(tokenizer)
    more_words.add_tokens(["Marlow"])
    other_pad = copy.deepcopy(tokenizer)
    other_pad.pad_token = other_pad.eos_token
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    seen = {base.report.fingerprint}
    for other in (more_words, other_pad, templated):
        again = prepare(tmp_path, other, train=path, max_length=64)
        assert not again.report.cache_hit and again.report.fingerprint not in seen
        seen.add(again.report.fingerprint)
    assert rows(prepare(tmp_path, more_words, train=path, max_length=64).train) != rows(base.train)


def test_on_bad_line_fail_on_a_cache_built_with_skip_still_fails_naming_file_and_line(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [*corpus_lines(3), "{not json", *corpus_lines(50)[3:]])
    built = prepare(tmp_path, tokenizer, train=path)
    assert built.report.skipped_lines == 1
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:4: not valid JSON"):
        prepare(tmp_path, tokenizer, train=path, on_bad_line="fail")
    assert [e["fingerprint"] for e in cache.entries(tmp_path / "cache")] == [built.report.fingerprint]


def test_a_bad_record_names_its_file_and_line(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [*corpus_lines(3), '{"text": null}', *corpus_lines(10)[3:]])
    assert prepare(tmp_path, tokenizer, train=path).report.skipped_examples == [
        f"{path}:4: field 'text' must be a string"
    ]
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:4: field 'text' must be a string"):
        prepare(tmp_path / "fresh", tokenizer, train=path, on_bad_line="fail")


# ---------------------------------------------------------------- every source kind gives the same rows


def records_of(path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def write_source(folder, kind: str, records: list[dict]):
    """``records`` as a file (or folder of files) of ``kind``; the path to name as paths.train_file."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl folder":  # read in name order
        for part, start in enumerate(range(0, len(records), 120)):
            write_lines(folder / f"part-{part}.jsonl", [json.dumps(r) for r in records[start : start + 120]])
        return folder
    if kind == "json array":
        (folder / "data.json").write_text(json.dumps(records, indent=1))
        return folder / "data.json"
    if kind == "csv":
        datasets.Dataset.from_list(records).to_csv(str(folder / "data.csv"), index=False)
        return folder / "data.csv"
    if kind == "parquet":
        datasets.Dataset.from_list(records).to_parquet(str(folder / "data.parquet"))
        return folder / "data.parquet"
    if kind == "parquet folder":
        half = len(records) // 2
        datasets.Dataset.from_list(records[:half]).to_parquet(str(folder / "a.parquet"))
        datasets.Dataset.from_list(records[half:]).to_parquet(str(folder / "b.parquet"))
        return folder
    if kind == "arrow":
        # An Arrow IPC stream, as datasets' arrow builder reads it (save_to_disk writes a folder, not this).
        table = pa.Table.from_pylist(records)
        with (
            pa.OSFile(str(folder / "data.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            writer.write_table(table)
        return folder / "data.arrow"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["jsonl folder", "json array", "csv", "parquet", "parquet folder", "arrow"])
@pytest.mark.parametrize("source", [CORPUS, INSTRUCTIONS], ids=["text", "instruction"])
def test_every_file_kind_gives_the_rows_of_the_same_jsonl(tmp_path, tokenizer, kind, source):
    records = records_of(source, 300)
    jsonl = write_lines(tmp_path / "same.jsonl", [json.dumps(r) for r in records])
    expected = prepare(tmp_path / "jsonl", tokenizer, train=jsonl, max_length=64, val_fraction=0.1)
    source_path = write_source(tmp_path / "src", kind, records)
    got = prepare(tmp_path / "other", tokenizer, train=source_path, max_length=64, val_fraction=0.1)
    assert rows(got.train) == rows(expected.train) and rows(got.val) == rows(expected.val)
    assert facts(got.report) == facts(expected.report)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_dataset_folder_with_named_splits_gives_the_rows_of_the_same_files(tmp_path, tokenizer, kind):
    import datasets

    records = records_of(CORPUS, 400)
    train, val = records[:300], records[300:]
    folder = tmp_path / "my-dataset"
    folder.mkdir()
    for split, part in (("train", train), ("validation", val)):
        if kind == "parquet":
            datasets.Dataset.from_list(part).to_parquet(str(folder / f"{split}.parquet"))
        else:
            write_lines(folder / f"{split}.jsonl", [json.dumps(r) for r in part])
    named = {"dataset": str(folder), "dataset_split": "train", "val_split": "validation"}
    got = prepare(tmp_path / "dataset", tokenizer, max_length=64, **named)
    expected = prepare(
        tmp_path / "files",
        tokenizer,
        train=write_lines(tmp_path / "train.jsonl", [json.dumps(r) for r in train]),
        val=write_lines(tmp_path / "val.jsonl", [json.dumps(r) for r in val]),
        max_length=64,
    )
    assert rows(got.train) == rows(expected.train) and rows(got.val) == rows(expected.val)
    assert facts(got.report) == facts(expected.report) and got.report.val_records == 100
    again = prepare(tmp_path / "dataset", tokenizer, max_length=64, **named)
    assert again.report.cache_hit and again.report.fingerprint == got.report.fingerprint


# ---------------------------------------------------------------- chat


def chat_records() -> list[tuple[int, dict]]:
    return [(n, json.loads(line)) for n, line in enumerate(CHAT.read_text().splitlines(), start=1)]


def test_chat_rows_learn_the_assistant_turns_only(tmp_path, tokenizer):
    data = prepare(tmp_path, tokenizer, train=CHAT, packing=False, val_fraction=0.0, max_length=1024)
    cfg = DataConfig()
    assert data.report.format == "chat" and data.report.truncation_would_lose_tokens == 0
    assert data.report.skipped_lines == 2
    assert data.report.skipped_examples == [f"{CHAT}:58: no assistant turn", f"{CHAT}:144: no assistant turn"]
    encoded, answers = [], []
    for n, record in chat_records():
        if n in (58, 144):
            continue
        messages = find_messages(record, cfg)
        encoded.append(encode_chat(messages, tokenizer, cfg))
        answers.append([m["content"] + "<|im_end|>" for m in messages[1:] if m["role"] == "assistant"])
    assert rows(data.train) == [(ids, labels, list(range(len(ids)))) for ids, labels in encoded]
    for row, turns in zip(data.train, answers):
        # Each run of learned tokens is (the end of) one assistant turn, and every turn has one.
        learned = row.labels != IGNORE
        starts = np.flatnonzero(learned & ~np.r_[False, learned[:-1]])
        ends = np.flatnonzero(learned & ~np.r_[learned[1:], False]) + 1
        runs = [tokenizer.decode(row.input_ids[a:b].tolist()) for a, b in zip(starts, ends)]
        assert len(runs) == len(turns) > 0
        assert all(
            turn.endswith(run.strip()) and len(run) > 0.5 * len(turn) for run, turn in zip(runs, turns)
        )

    packed = prepare(tmp_path, tokenizer, train=CHAT, val_fraction=0.0, max_length=512)
    assert rows(packed.train) == rows(pack(encoded, 512, tokenizer.pad_token_id))


# ---------------------------------------------------------------- the cache and preprocess commands


def age(folder, days: float) -> None:
    """Make a cache look built and last used ``days`` ago."""
    meta_path = folder / cache.META
    meta = json.loads(meta_path.read_text())
    meta["created"] -= days * 86400
    meta_path.write_text(json.dumps(meta))
    then = time.time() - days * 86400
    os.utime(meta_path, (then, then))


def test_cache_list_and_clear(tmp_path, tokenizer, capsys):
    root = tmp_path / "cache"
    path = write_lines(tmp_path / "d.jsonl", corpus_lines(100))
    fps = [prepare(tmp_path, tokenizer, train=path, max_length=n).report.fingerprint for n in (32, 64, 128)]
    capsys.readouterr()
    assert main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert all(fp in out for fp in fps) and "3 cache(s)" in out and str(path) in out
    assert main(["cache", "list", "--json", "--cache-dir", str(root)]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(e["fingerprint"] for e in listed) == sorted(fps)
    assert {e["max_length"] for e in listed} == {32, 64, 128} and all(e["bytes"] > 0 for e in listed)

    assert main(["cache", "clear", "0123456789abcdef01234567", "--cache-dir", str(root)]) == 2
    assert "no cache '0123456789abcdef01234567'" in capsys.readouterr().err
    assert main(["cache", "clear", "--cache-dir", str(root)]) == 2  # nothing named
    assert sorted(e["fingerprint"] for e in cache.entries(root)) == sorted(fps)

    assert main(["cache", "clear", fps[0], "--cache-dir", str(root)]) == 0
    assert "removed 1 cache(s)" in capsys.readouterr().out and not (root / fps[0]).exists()

    # Unused for ten days; listing it (which reads its meta.json) does not make it recent.
    age(root / fps[1], days=10)
    assert main(["cache", "list", "--cache-dir", str(root)]) == 0
    assert main(["cache", "clear", "--older-than", "5", "--cache-dir", str(root)]) == 0
    assert "removed 1 cache(s)" in capsys.readouterr().out
    assert [e["fingerprint"] for e in cache.entries(root)] == [fps[2]]

    # Used again, a cache is recent again.
    age(root / fps[2], days=10)
    assert prepare(tmp_path, tokenizer, train=path, max_length=128).report.cache_hit
    assert main(["cache", "clear", "--older-than", "5", "--cache-dir", str(root)]) == 0
    assert [e["fingerprint"] for e in cache.entries(root)] == [fps[2]]

    assert main(["cache", "clear", "--all", "--cache-dir", str(root)]) == 0
    assert cache.entries(root) == [] and not (root / fps[2]).exists()
    capsys.readouterr()
    assert main(["cache", "list", "--cache-dir", str(root)]) == 0
    assert "0 cache(s)" in capsys.readouterr().out
    assert not prepare(tmp_path, tokenizer, train=path, max_length=128).report.cache_hit


def test_preprocess_builds_the_cache_and_a_second_run_reuses_it(tmp_path, capsys):
    def config(name: str):
        cfg = deep_merge(TINY, {"paths": {"output_dir": str(tmp_path / name)}})
        cfg["data"] = {**cfg["data"], "cache_dir": str(tmp_path / "cache")}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    assert main(["preprocess", "--config", str(config("first"))]) == 0
    out = capsys.readouterr().out
    fingerprint = re.search(r"data cache (\w+) built", out).group(1)
    assert [e["fingerprint"] for e in cache.entries(tmp_path / "cache")] == [fingerprint]
    result = run_trainer("preprocess", "--config", str(config("second")))  # another process, another run
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"data cache {fingerprint} reused" in result.stdout


# ---------------------------------------------------------------- a killed build


def test_a_killed_build_is_cleaned_and_never_read(tmp_path, tokenizer):
    root = tmp_path / "cache"
    path = write_lines(tmp_path / "d.jsonl", corpus_lines(100))
    first = prepare(tmp_path, tokenizer, train=path, max_length=64)
    fingerprint, first_rows = first.report.fingerprint, (rows(first.train), rows(first.val))
    cache.remove(root, fingerprint)
    # What a build killed before its rename leaves: a temporary folder, here one that even looks complete.
    left = root / f".tmp-{fingerprint}-otherhost-4242"
    left.mkdir()
    (left / cache.META).write_text(json.dumps({"kind": cache.KIND, "report": {}, "dtypes": {}}))
    (left / "train.ids.bin").write_bytes(b"\0" * 64)
    assert cache.entries(root) == []
    again = prepare(tmp_path, tokenizer, train=path, max_length=64)
    assert not again.report.cache_hit and again.report.fingerprint == fingerprint
    assert (rows(again.train), rows(again.val)) == first_rows and facts(again.report) == facts(first.report)
    assert not left.exists() and not list(root.glob(".tmp-*"))


def test_cache_clear_removes_builds_left_by_killed_processes_but_not_one_under_way(tmp_path):
    """A build's temporary folder is removed by ``cache clear`` only when no process holds its lock."""
    from filelock import FileLock

    root = tmp_path / "cache"
    root.mkdir()
    abandoned = root / ".tmp-aaaaaaaaaaaaaaaaaaaaaaaa-host-1"
    running = root / ".tmp-bbbbbbbbbbbbbbbbbbbbbbbb-host-2"
    for folder in (abandoned, running):
        folder.mkdir()
        (folder / "train.ids.bin").write_bytes(b"\0" * 4096)
    with FileLock(str(root / "bbbbbbbbbbbbbbbbbbbbbbbb.lock")):
        assert main(["cache", "clear", "--all", "--cache-dir", str(root)]) == 0
        assert not abandoned.exists() and running.exists()
