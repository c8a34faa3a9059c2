"""Data: malformed lines, deterministic splits, packing without cross-document leakage, prompt masking."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.helpers import REPO, run_trainer
from trainer.config import DataConfig, PathsConfig
from trainer.data import sources
from trainer.data.dataset import IGNORE, DataError, pack, prepare_data
from trainer.data.prepare import val_ordinals


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-moe")


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def prepare(tmp_path, train_file, tokenizer, workers=0, **data):
    """``prepare_data`` of one file into a cache of this test's own; packing off and no validation unless asked."""
    cfg = DataConfig(**{"packing": False, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache"), **data})
    return prepare_data(
        PathsConfig(train_file=str(train_file)), cfg, tokenizer, True, workers, log=lambda *a, **k: None
    )


def encoded(tokenizer, text: str) -> list[int]:
    """A text record's ids as the data layer writes them: BOS + text + EOS."""
    return [
        tokenizer.bos_token_id,
        *tokenizer(text, add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    ]


def test_malformed_line_skipped_and_counted(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "{not json", '["a list"]', '{"text": "b"}'])
    data = prepare(tmp_path, path, tokenizer)
    assert [row.input_ids.tolist() for row in data.train] == [
        encoded(tokenizer, "a"),
        encoded(tokenizer, "b"),
    ]
    assert data.report.train_records == 2
    assert data.report.skipped_lines == 2
    assert data.report.skipped_examples[0].startswith(f"{path}:2: not valid JSON")
    assert data.report.skipped_examples[1] == f"{path}:3: expected a JSON object"


def test_malformed_line_fatal_names_file_and_line(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "{not json"])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not valid JSON"):
        prepare(tmp_path, path, tokenizer, on_bad_line="fail")


@pytest.mark.slow
def test_cli_bad_data_exit_2_and_skip_count_logged(write_config, tmp_path):
    data = write_lines(
        tmp_path / "d.jsonl", [json.dumps({"text": "Ada lives in Marlow. " * 20})] * 60 + ["oops"]
    )
    fail = write_config(
        {"paths": {"train_file": str(data)}, "data": {"on_bad_line": "fail"}}, "fail.yaml", "f"
    )
    result = run_trainer("train", "--config", str(fail))
    assert result.returncode == 2
    assert f"{data}:61: not valid JSON" in result.stderr
    skip = write_config(
        {"paths": {"train_file": str(data)}, "training": {"max_steps": 2, "micro_batch_size": 2}},
        "skip.yaml",
        "s",
    )
    result = run_trainer("train", "--config", str(skip))
    assert result.returncode == 0, result.stderr[-2000:]
    report = [
        json.loads(line) for line in (tmp_path / "s" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    data_report = next(e for e in report if e["event"] == "data_report")
    assert data_report["skipped_lines"] == 1 and data_report["skipped_examples"][0].startswith(f"{data}:61")


def test_tsv_with_header(tmp_path, tokenizer):
    path = tmp_path / "d.tsv"
    path.write_text("text\tsource\nhello there\tweb\nbroken\n")
    data = prepare(tmp_path, path, tokenizer)
    assert [row.input_ids.tolist() for row in data.train] == [encoded(tokenizer, "hello there")]
    assert data.report.train_records == 1 and data.report.skipped_lines == 1
    assert data.report.skipped_examples == [f"{path}:3: expected 2 tab-separated fields, got 1"]


def test_split_is_deterministic_and_disjoint(tmp_path, tokenizer):
    assert val_ordinals(100, 0.1, seed=7).tolist() == val_ordinals(100, 0.1, seed=7).tolist()
    assert len(val_ordinals(100, 0.1, seed=7)) == 10
    assert val_ordinals(100, 0.1, seed=7).tolist() != val_ordinals(100, 0.1, seed=8).tolist()

    texts = [f"record {i}" for i in range(100)]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": t}) for t in texts])
    which = {tuple(encoded(tokenizer, t)): i for i, t in enumerate(texts)}

    def split(seed: int, cache: str) -> tuple[list[int], list[int]]:
        data = prepare(tmp_path / cache, path, tokenizer, val_fraction=0.1, seed=seed)
        assert not data.report.cache_hit  # each split built afresh, not read back
        return [which[tuple(r.input_ids.tolist())] for r in data.train], [
            which[tuple(r.input_ids.tolist())] for r in data.val
        ]

    train_a, val_a = split(7, "a")
    train_b, val_b = split(7, "b")
    _, val_c = split(8, "c")
    assert val_a == val_b and len(val_a) == 10 and val_a != val_c
    assert val_a == val_ordinals(100, 0.1, seed=7).tolist()  # in file order
    assert train_a == train_b == sorted(set(range(100)) - set(val_a))


def test_packing_restarts_positions_and_masks_boundaries():
    docs = [
        ([1, 10, 11, 12], [1, 10, 11, 12]),
        ([1, 20, 21], [1, 20, 21]),
        ([1, 30, 31, 32, 33, 34], [1, 30, 31, 32, 33, 34]),
    ]
    rows = pack(docs, max_length=8, pad_id=0)
    assert [r.input_ids.tolist() for r in rows] == [
        [1, 10, 11, 12, 1, 20, 21, 1],
        [30, 31, 32, 33, 34, 0, 0, 0],
    ]
    assert rows[0].position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # The first token of every segment is never a target: nothing is predicted across a boundary.
    assert rows[0].labels.tolist() == [IGNORE, 10, 11, 12, IGNORE, 20, 21, IGNORE]
    assert rows[1].labels.tolist() == [IGNORE, 31, 32, 33, 34, IGNORE, IGNORE, IGNORE]
    # The last row's padding counts on from its last segment: no document of its own, so the batch holding
    # it stays plain (no block-diagonal mask), and CUDA graphs captured on plain rows replay it.
    assert rows[1].position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    from trainer.data.batches import collate
    from trainer.families.base import has_document_boundaries

    assert not has_document_boundaries(collate([rows[1]], pad_id=0))
    assert has_document_boundaries(collate([rows[0]], pad_id=0))


def test_packed_documents_do_not_see_each_other():
    """Changing document A must not change the logits of document B packed after it (as the loop calls
    the model: restarting position_ids, no attention mask, no cache)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama")
    ).eval()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    a = torch.tensor([[1, 5, 6, 7, 1, 8, 9, 10]])
    b = torch.tensor([[1, 50, 60, 70, 1, 8, 9, 10]])
    with torch.no_grad():
        la = model(input_ids=a, position_ids=positions, use_cache=False).logits
        lb = model(input_ids=b, position_ids=positions, use_cache=False).logits
    assert torch.allclose(la[0, 4:], lb[0, 4:], atol=1e-5)
    assert not torch.allclose(la[0, :4], lb[0, :4], atol=1e-3)


def test_long_documents_split_not_truncated(tmp_path, tokenizer):
    text = " ".join(["Ada lives in Marlow and works as a baker."] * 40)
    ids = encoded(tokenizer, text)
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": text})])
    split = prepare(tmp_path / "split", path, tokenizer, max_length=32)
    trunc = prepare(tmp_path / "trunc", path, tokenizer, max_length=32, long_documents="truncate")
    assert np.concatenate([r.input_ids for r in split.train]).tolist() == ids
    assert [r.position_ids.tolist() for r in split.train][:2] == [list(range(32))] * 2
    assert len(trunc.train) == 1 and trunc.train[0].input_ids.tolist() == ids[:32]
    assert split.report.truncation_would_lose_tokens == len(ids) - 32 == trunc.report.truncated_tokens
    assert split.report.truncated_tokens == 0


def test_instruction_records_learn_only_the_response(tmp_path, tokenizer):
    data = prepare(tmp_path, REPO / "data" / "tiny_instructions.jsonl", tokenizer)
    assert data.report.format == "instruction"
    row = data.train[0]
    decoded = tokenizer.decode(row.labels[row.labels != IGNORE].tolist())
    assert "Answer:" not in decoded and "Question" not in decoded and decoded.endswith("</s>")
    assert row.labels[:3].tolist() == [IGNORE] * 3


def test_one_and_two_data_workers_give_the_same_rows(tmp_path, tokenizer, monkeypatch):
    """Byte ranges spread over worker processes: the same rows, split and line numbers as one process."""
    lines = (REPO / "data" / "tiny_corpus.jsonl").read_text().splitlines()
    lines.insert(1500, "{not json")
    path = write_lines(tmp_path / "corpus.jsonl", lines)
    monkeypatch.setattr(sources, "RANGE_BYTES", 64 << 10)
    assert len(sources.line_ranges([path])) > 10
    one = prepare(
        tmp_path / "one", path, tokenizer, workers=1, packing=True, val_fraction=0.05, max_length=64
    )
    two = prepare(
        tmp_path / "two", path, tokenizer, workers=2, packing=True, val_fraction=0.05, max_length=64
    )
    assert one.report.fingerprint == two.report.fingerprint  # the workers do not change the rows
    for split in ("train", "val"):
        a, b = getattr(one, split), getattr(two, split)
        assert len(a) == len(b) > 0
        for field in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(
                np.concatenate([getattr(r, field) for r in a]), np.concatenate([getattr(r, field) for r in b])
            )
    assert dataclasses.replace(one.report, cache="", prepare_seconds=0) == dataclasses.replace(
        two.report, cache="", prepare_seconds=0
    )
    assert one.report.skipped_examples == [
        f"{path}:1501: not valid JSON (Expecting property name enclosed in double quotes)"
    ]
