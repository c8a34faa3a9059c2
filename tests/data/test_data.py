"""Data: malformed lines, deterministic splits, packing without cross-document leakage, prompt masking."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.helpers import REPO, run_trainer
from trainer.config import DataConfig, PathsConfig
from trainer.data.dataset import (
    IGNORE,
    DataError,
    DataReport,
    build_sequences,
    pack,
    prepare_data,
    read_records,
    split_records,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-moe")


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_malformed_line_skipped_and_counted(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "{not json", '["a list"]', '{"text": "b"}'])
    report = DataReport()
    records = read_records(path, "skip", report)
    assert [r["text"] for r in records] == ["a", "b"]
    assert report.skipped_lines == 2
    assert report.skipped_examples[0].startswith(f"{path}:2: not valid JSON")
    assert report.skipped_examples[1] == f"{path}:3: expected a JSON object"


def test_malformed_line_fatal_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "{not json"])
    with pytest.raises(DataError, match=rf"^{path}:2: not valid JSON"):
        read_records(path, "fail", DataReport())


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


def test_tsv_with_header(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("text\tsource\nhello there\tweb\nbroken\n")
    report = DataReport()
    assert read_records(path, "skip", report) == [{"text": "hello there", "source": "web"}]
    assert report.skipped_lines == 1


def test_split_is_deterministic_and_disjoint():
    records = [{"text": str(i)} for i in range(100)]
    train_a, val_a = split_records(records, 0.1, seed=7)
    train_b, val_b = split_records(records, 0.1, seed=7)
    _, val_c = split_records(records, 0.1, seed=8)
    assert val_a == val_b and len(val_a) == 10 and val_a != val_c
    assert {r["text"] for r in train_a} | {r["text"] for r in val_a} == {str(i) for i in range(100)}
    assert not {r["text"] for r in train_a} & {r["text"] for r in val_a}


def test_packing_restarts_positions_and_masks_boundaries():
    docs = [
        ([1, 10, 11, 12], [1, 10, 11, 12]),
        ([1, 20, 21], [1, 20, 21]),
        ([1, 30, 31, 32, 33, 34], [1, 30, 31, 32, 33, 34]),
    ]
    rows = pack(docs, max_length=8, pad_id=0)
    assert [r.input_ids for r in rows] == [[1, 10, 11, 12, 1, 20, 21, 1], [30, 31, 32, 33, 34, 0, 0, 0]]
    assert rows[0].position_ids == [0, 1, 2, 3, 0, 1, 2, 0]
    # The first token of every segment is never a target: nothing is predicted across a boundary.
    assert rows[0].labels == [IGNORE, 10, 11, 12, IGNORE, 20, 21, IGNORE]
    assert rows[1].labels == [IGNORE, 31, 32, 33, 34, IGNORE, IGNORE, IGNORE]
    assert rows[1].position_ids == [0, 1, 2, 3, 4, 0, 1, 2]


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


def test_long_documents_split_not_truncated(tokenizer):
    text = " ".join(["Ada lives in Marlow and works as a baker."] * 40)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    docs = [(ids, ids)]
    split_report, trunc_report = DataReport(), DataReport()
    split_rows = build_sequences(docs, DataConfig(max_length=32), 0, split_report, packing=False)
    trunc_rows = build_sequences(
        docs, DataConfig(max_length=32, long_documents="truncate"), 0, trunc_report, packing=False
    )
    assert sum(len(r.input_ids) for r in split_rows) == len(ids)
    assert len(trunc_rows) == 1
    assert split_report.truncation_would_lose_tokens == len(ids) - 32 == trunc_report.truncated_tokens
    assert split_report.truncated_tokens == 0


def test_instruction_records_learn_only_the_response(tokenizer):
    paths = PathsConfig(train_file=str(REPO / "data" / "tiny_instructions.jsonl"))
    data = prepare_data(paths, DataConfig(packing=False, val_fraction=0.0), tokenizer, family_packing=True)
    assert data.report.format == "instruction"
    row = data.train[0]
    targets = [t for t in row.labels if t != IGNORE]
    decoded = tokenizer.decode(targets)
    assert "Answer:" not in decoded and "Question" not in decoded and decoded.endswith("</s>")
    assert row.labels[:3] == [IGNORE] * 3


def test_tokenizing_in_threads_gives_the_same_rows(tokenizer):
    paths = PathsConfig(train_file=str(REPO / "data" / "tiny_corpus.jsonl"))
    one = prepare_data(paths, DataConfig(max_length=64), tokenizer, family_packing=True, workers=0)
    four = prepare_data(paths, DataConfig(max_length=64), tokenizer, family_packing=True, workers=4)
    assert [r.input_ids for r in one.train] == [r.input_ids for r in four.train]
    assert [r.labels for r in one.val] == [r.labels for r in four.val]
