"""``preprocess --analyze-only``: length distribution and per-strategy costs, checked against hand counts.

The hand-counted tests use a word tokenizer (one token per whitespace-separated word, BOS and EOS
one each), so every expected number below can be checked with a pencil.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.data.reference_rows import DataReport, build_sequences, read_records, tokenize_record
from tests.helpers import REPO, TINY, deep_merge, run_trainer
from trainer.cli import main
from trainer.config import Config, DataConfig, ModelConfig, PathsConfig
from trainer.data.length_report import (
    REPORT_JSON,
    REPORT_MD,
    encode_texts,
    format_markdown,
    histogram,
    pack_pieces,
    percentile,
    piece_counts,
    split_text,
    summary_line,
    write_data_report,
)
from trainer.data.prepare import analyze


class WordTokenizer:
    """No offsets, like a slow tokenizer: pieces are counted by tokenizing them."""

    bos_token_id, eos_token_id, pad_token_id, name_or_path, chat_template = 1, 2, 0, "words", None

    def __len__(self):
        return 4

    def get_vocab(self):
        return {"<pad>": 0, "<s>": 1, "</s>": 2, "w": 3}

    def __call__(self, text, add_special_tokens=False):
        if isinstance(text, list):
            return {"input_ids": [[3] * len(t.split()) for t in text]}
        return {"input_ids": [3] * len(text.split())}


class FastWordTokenizer(WordTokenizer):
    """With offsets, like a fast tokenizer: the record is tokenized once and pieces counted by offsets."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = super().__call__(text, add_special_tokens)
        if return_offsets_mapping:
            spans = [[m.span() for m in re.finditer(r"\S+", t)] for t in text]
            out["offset_mapping"] = spans
        return out


R1 = "One two three. Four five six seven.\n\nEight nine ten eleven twelve thirteen fourteen fifteen sixteen."
R2 = "Short one."
R3 = "Alpha beta gamma delta. Epsilon zeta eta theta. Iota kappa lambda mu."
R4 = "six words and no full stop"
# Tokens with BOS and EOS: R1 7+9 words -> 18, R2 -> 4, R3 12 words -> 14, R4 -> 8.


def config_for(tmp_path, lines: list[str], max_length: int = 8, **data) -> Config:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return Config(paths=PathsConfig(train_file=str(path)), data=DataConfig(max_length=max_length, **data))


def text_lines() -> list[str]:
    return [json.dumps({"text": t}) for t in (R1, R2, R3)] + ["{not json"] + [json.dumps({"text": R4})]


def test_splitting_keeps_every_character():
    assert split_text(R1, "paragraph") == ["One two three. Four five six seven.\n\n", R1.split("\n\n")[1]]
    assert split_text(R1, "sentence") == [
        "One two three. ",
        "Four five six seven.\n\n",
        "Eight nine ten eleven twelve thirteen fourteen fifteen sixteen.",
    ]
    tricky = 'He said "stop!" Then left?  Yes.\n\n\nEnd'
    assert split_text(tricky, "sentence") == ['He said "stop!" ', "Then left?  ", "Yes.\n\n\n", "End"]
    for text in (R1, R2, R3, tricky, "", "no breaks at all"):
        for strategy in ("paragraph", "sentence"):
            assert "".join(split_text(text, strategy)) == text


def test_percentiles_histogram_and_packing_by_hand():
    assert [percentile([4, 8, 14, 18], p) for p in (50, 90, 95, 99)] == [8, 18, 18, 18]
    assert [percentile(list(range(1, 101)), p) for p in (50, 90, 95, 99)] == [50, 90, 95, 99]
    assert histogram([1, 2, 7, 12, 19], bins=4) == {"edges": [0, 5, 10, 15, 20], "counts": [2, 1, 1, 1]}
    # 5 opens a chunk (3 left), 4 opens another (4 left), 4 fills it, 10 is a chunk of its own,
    # unsplittable (2 lost).
    assert piece_counts(["ab cd. ", "ef\n\n", "gh"], [0, 3, 7, 11]) == [2, 1, 1]
    assert pack_pieces([5, 4, 4, 10], 8) == {
        "chunks": 3,
        "unsplittable_segments": 1,
        "unsplittable_tokens": 10,
        "lost_tokens": 2,
    }


@pytest.mark.parametrize("tokenizer", [WordTokenizer(), FastWordTokenizer()], ids=["slow", "fast"])
def test_text_records_counted_by_hand(tmp_path, tokenizer):
    report = analyze(config_for(tmp_path, text_lines()), tokenizer)
    assert report["format"] == "text" and report["max_length"] == 8
    assert (report["records_total"], report["records_analyzed"], report["skipped_records"]) == (5, 4, 1)
    assert report["sampled"] is False
    # Lengths 18, 4, 14, 8.
    assert report["lengths"] == {
        "count": 4,
        "min": 4,
        "median": 8,
        "p90": 18,
        "p95": 18,
        "p99": 18,
        "max": 18,
        "mean": 11.0,
        "total_tokens": 44,
    }
    assert report["over_max_length"] == {"records": 2, "fraction": 0.5}
    s = report["strategies"]
    # truncate: 18 -> 10 lost, 14 -> 6 lost.
    assert (s["truncate"]["lost_tokens"], s["truncate"]["records_with_loss"], s["truncate"]["chunks"]) == (
        16,
        2,
        4,
    )
    assert report["truncation_lost_fraction"] == round(16 / 44, 4)
    # token windows: 3 + 1 + 2 + 1.
    assert s["token"]["chunks"] == 7 and s["token"]["lost_tokens"] == 0
    assert s["token"]["chunks_per_record"] == {"mean": 1.75, "max": 3, "histogram": {"1": 2, "2": 1, "3": 1}}
    # paragraph: R1 = [7+BOS=8, 9+EOS=10] -> 2 chunks, the 10 unsplittable (2 lost);
    # R3 is one 14-token paragraph -> unsplittable (6 lost); R2, R4 one chunk each.
    p = s["paragraph"]
    assert (p["chunks"], p["unsplittable_segments"], p["unsplittable_tokens"]) == (5, 2, 24)
    assert (p["lost_tokens"], p["records_with_loss"], p["segments"]) == (8, 2, 5)
    # sentence: R1 = [4, 4, 10] -> 2 chunks (10 unsplittable, 2 lost); R3 = [5, 4, 5] -> 3 chunks, no loss.
    t = s["sentence"]
    assert (t["chunks"], t["unsplittable_segments"], t["unsplittable_tokens"]) == (7, 1, 10)
    assert (t["lost_tokens"], t["records_with_loss"]) == (2, 1)
    assert t["chunks_per_record"]["histogram"] == {"1": 2, "2": 1, "3": 1}


def test_instruction_records_lose_their_response_to_truncation(tmp_path):
    lines = [
        json.dumps({"prompt": "a b c", "response": "d e f g h i j"}),  # BOS+3 | 7+EOS = 12 tokens
        json.dumps({"prompt": "q", "response": "r"}),  # 4 tokens
    ]
    report = analyze(config_for(tmp_path, lines), WordTokenizer())
    assert report["format"] == "instruction"
    truncate = report["strategies"]["truncate"]
    assert truncate["lost_tokens"] == 4 and truncate["lost_target_tokens"] == 4
    assert report["strategies"]["token"]["chunks"] == 3
    assert report["strategies"]["paragraph"]["applicable"] is False
    md = format_markdown(report)
    assert "| paragraph | n/a |" in md and "4 of the lost tokens are trained on" in md


def test_written_json_and_markdown(tmp_path):
    report = analyze(config_for(tmp_path, text_lines()), WordTokenizer())
    json_path, md_path = write_data_report(report, tmp_path / "run")
    assert json_path == tmp_path / "run" / REPORT_JSON and md_path == tmp_path / "run" / REPORT_MD
    stored = json.loads(json_path.read_text())
    assert stored["strategies"] == report["strategies"] and isinstance(stored["ts"], float)
    md = md_path.read_text()
    assert "| 4 | 8 | 18 | 18 | 18 | 18 | 11.0 | 44 |" in md
    assert "| truncate | 4 | 1, 1 | - | 16 (36.4%) | 2 |" in md
    assert "| paragraph | 5 | 1.25, 2 | 2 (24) | 8 (18.2%) | 2 |" in md
    line = summary_line(report)
    assert "median 8" in line and "2 of 4 records exceed max_length 8" in line and "lose 16 tokens" in line


def test_real_tokenizer_agrees_with_the_training_data_path(tmp_path):
    """The loss counted here (from the data cache) equals what the list-based loader's build_sequences
    reported for the same records."""
    from trainer.model.loading import load_tokenizer

    cfg = Config(
        paths=PathsConfig(train_file=str(REPO / "data" / "tiny_corpus.jsonl")),
        model=ModelConfig(name_or_path=str(REPO / "configs" / "tiny-moe")),
        data=DataConfig(max_length=64),
    )
    tokenizer = load_tokenizer(cfg)
    report = analyze(cfg, tokenizer)
    records = read_records(cfg.paths.train_file, "skip", DataReport())
    picked = records
    tokenized = [tokenize_record(r, tokenizer, cfg.data, "text", "x") for r in picked]
    data_report = DataReport()
    build_sequences(tokenized, cfg.data, 0, data_report, packing=False)
    assert report["strategies"]["truncate"]["lost_tokens"] == data_report.truncation_would_lose_tokens > 0
    assert report["lengths"]["max"] == max(len(ids) for ids, _ in tokenized)
    assert report["strategies"]["token"]["chunks"] == sum(-(-len(ids) // 64) for ids, _ in tokenized)
    # Pieces counted by offsets add up to their record exactly.
    texts = [r["text"] for r in picked[:50]]
    counts, starts = encode_texts(tokenizer, texts)
    assert starts is not None  # a fast tokenizer: one tokenization per record
    for text, count, st in zip(texts, counts, starts):
        for strategy in ("paragraph", "sentence"):
            assert sum(piece_counts(split_text(text, strategy), st)) == count


def test_cli_writes_both_files_into_the_output_folder(tmp_path):
    out = tmp_path / "run"
    cfg = deep_merge(TINY, {"paths": {"output_dir": str(out)}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = run_trainer("preprocess", "--analyze-only", "--config", str(path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / REPORT_JSON).read_text())
    assert report["records_analyzed"] == 2400 and report["sampled"] is False and report["max_length"] == 64
    assert report["tokenizer"].endswith("tiny-moe")
    assert "| strategy | chunks |" in (out / REPORT_MD).read_text()
    assert "lengths (tokens): median" in result.stdout and str(out / REPORT_JSON) in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--analyze-only", "--set", "paths.train_file=/nope.jsonl"], "paths.train_file"),
    ],
)
def test_cli_refuses_bad_input_with_exit_2(args, message, capsys):
    assert main(["preprocess", *args]) == 2
    assert message in capsys.readouterr().err
