"""bench/bench_packing_gpu.py: its length sampler, batching and packed-vs-alone check on CPU, and the
whole script end to end on a tiny saved model (the GPU run only changes sizes and kernels)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_packing_gpu", REPO / "bench" / "bench_packing_gpu.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-saved")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama")
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "configs" / "tiny-llama" / name, folder / name)
    return folder


def test_lengths_are_seeded_log_normal_with_median_250_and_a_capped_tail():
    lengths = bench.sample_lengths(4000, seed=3)
    assert lengths == bench.sample_lengths(4000, seed=3)
    assert lengths != bench.sample_lengths(4000, seed=4)
    assert 225 <= statistics.median(lengths) <= 275
    assert max(lengths) == 2048 and min(lengths) >= 8  # the tail reaches the cap
    assert 0.005 < sum(n >= 1500 for n in lengths) / len(lengths) < 0.05
    assert statistics.mean(lengths) > 1.4 * statistics.median(lengths)  # skewed: a long tail


def test_packed_batches_compute_far_fewer_tokens_than_padded_ones():
    docs = bench.make_documents(bench.sample_lengths(200, seed=0, cap=512), seed=0, vocab=1024)
    assert all(3 <= t < 1024 for d in docs for t in d)
    packed = bench.kit_batches(docs, max_length=512, micro=2, pad_id=0)
    padded = [bench.pad_batch(docs[i : i + 8], pad_id=0) for i in range(0, len(docs), 8)]
    real = sum(len(d) - 1 for d in docs)
    assert sum(bench.count_targets(b["labels"]) for b in padded) == real
    # Packing loses one target where a document continues on the next row, and nothing else.
    split = sum(bench.count_targets(b["labels"]) for b in packed)
    assert real - len(packed) * 2 <= split <= real
    assert all(b["input_ids"].shape[1] == 512 for b in packed)
    assert sum(b["input_ids"].numel() for b in packed) < 0.75 * sum(b["input_ids"].numel() for b in padded)
    first = padded[0]
    assert first["input_ids"].shape[1] == max(len(d) for d in docs[:8])
    assert (first["labels"][first["attention_mask"] == 0] == bench.IGNORE).all()


def test_steady_rate_leaves_out_warmup():
    rate = bench.steady_rate([9.0, 1.0, 1.0], [100, 100, 300], warmup=1)
    assert rate["real_tokens_per_s"] == 200.0 and rate["timed_steps"] == 2 and rate["steps"] == 3


def test_doc_check_is_zero_without_leaks_and_large_with_them(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    import trainer.families

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    docs = bench.make_documents([30, 50, 20, 40], seed=0, vocab=1024)
    accel = bench.Accelerator("cpu")
    assert bench.doc_check(model, docs, 256, 0, accel) < 1e-5
    # Without position ids, packed documents see each other: the check must show it.
    leaking = dataclasses.replace(
        trainer.families.CAUSAL, model_inputs=lambda batch: {"input_ids": batch["input_ids"]}
    )
    monkeypatch.setattr(trainer.families, "CAUSAL", leaking)
    assert bench.doc_check(model, docs, 256, 0, accel) > 1e-3


def test_a_variant_that_fails_or_hangs_is_a_row(tiny_model, tmp_path):
    args = bench.parse(["--model", str(tiny_model), "--device", "cpu", "--work", str(tmp_path)])
    row = bench.run_variant(args, "kit-sdpa", timeout=0.5)
    assert row == {"variant": "kit-sdpa", "error": "timed out after 0s"}
    table = bench.table([row, {"variant": "hf-liger", "error": "exit 1: boom"}])
    assert "kit-sdpa    ERROR timed out" in table and "ERROR exit 1: boom" in table


def test_missing_model_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_packing_gpu.py"), "--model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"--model: {tmp_path / 'model.safetensors'} is missing" + (
        " (bench/profile_fast_path.py --model DIR --save-model writes one)"
    )


def test_script_runs_end_to_end_on_cpu(tiny_model, tmp_path):
    """Both sides train the same documents; the table and the JSON carry the rates and the ratio."""
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "bench" / "bench_packing_gpu.py"), "--model", str(tiny_model)]
    command += ["--device", "cpu", "--variants", "kit-sdpa,hf-liger", "--documents", "24", "--median", "40"]
    command += ["--max-length", "128", "--micro", "2", "--hf-batch", "4", "--max-steps", "3", "--warmup", "1"]
    command += ["--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads((out / "bench_packing.json").read_text())["rows"]}
    kit, hf = rows["kit-sdpa"], rows["hf-liger"]
    assert kit["steps"] == 3 and hf["steps"] == 3
    assert kit["doc_check_rel_diff"] < 1e-5 and kit["attention"] == "sdpa"
    assert kit["tokens_computed_per_target"] < hf["tokens_computed_per_target"]
    assert kit["ratio_vs_hf_liger"] == round(kit["real_tokens_per_s"] / hf["real_tokens_per_s"], 3)
    assert "kit-sdpa" in done.stdout and "real tok/s" in done.stdout
