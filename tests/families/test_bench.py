"""bench/bench_families.py (a GPU benchmark) keeps working: on a CPU at toy size, Mamba-2's fast rows
are skipped with the reason, the reference row trains, and the JSON and the table come out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_families", REPO / "bench" / "bench_families.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_families"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_smoke_on_cpu_skips_missing_kernels_and_runs_the_reference(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "families.json"
    args = ["--smoke", "--inline", "--only", "mamba2", "--steps", "2", "--out", str(out)]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == [
        "mamba2-130m lora fast",
        "mamba2-130m dora fast",
        "mamba2-130m lora reference",
        "mamba2-130m lora trainer+peft",
        "mamba2-130m qlora fast",
        "mamba2-130m qlora reference",
    ]
    for name in ("mamba2-130m lora fast", "mamba2-130m dora fast", "mamba2-130m qlora fast"):
        assert rows[name]["status"] == "skipped" and "no fast Mamba-2 kernels" in rows[name]["reason"]
    reference = rows["mamba2-130m lora reference"]
    assert reference["status"] == "ok" and reference["kernel_path"] == "torch-reference"
    assert (
        reference["fast_path"]["enabled"] is False and "reference kernels" in reference["fast_path"]["reason"]
    )
    assert reference["tokens_per_s"] > 0 and reference["steps"] == 2 and reference["packing"] is False
    peer = rows["mamba2-130m lora trainer+peft"]  # the peer (issue 30.5): Trainer + PEFT on the same model
    assert peer["status"] == "ok" and peer["kernel_path"] == "torch-reference (Trainer)", peer
    assert peer["tokens_per_s"] > 0 and 0 < peer["trainable_params_m"] < peer["total_params_m"]
    assert peer["first_loss"] is not None
    qlora = rows["mamba2-130m qlora reference"]  # Mamba QLoRA (issue 14 item 3): 4-bit base, LoRA trains
    assert qlora["status"] == "ok" and qlora["method"] == "qlora" and qlora["last_loss"] < qlora["first_loss"]
    assert report["environment"]["cuda"] is False and report["summary"] == []
    table = capsys.readouterr().out
    assert "mamba2-130m lora reference   torch-reference" in table and "SKIPPED: no fast Mamba-2" in table


def test_kernel_profile_sorts_the_families_kernels_into_their_categories():
    sys.path.insert(0, str(REPO))
    from bench.kernel_profile import category

    assert category("chunk_fwd_kernel_h") == category("_gated_dqk_kernel") == "scan / conv (fla, mamba_ssm)"
    assert category("causal_conv1d_bwd_kernel") == "scan / conv (fla, mamba_ssm)"
    assert category("layer_norm_bwd_kernel_group") == "norm"
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert category("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel") == (
        "copy / cast"
    )


def test_bench_peer_lines_name_the_target():
    bench = load_bench()
    kit = {"row": "gla-340m lora", "status": "ok", "tokens_per_s": 90000.0, "peak_gib": 20.0}
    peer = {"row": "gla-340m lora trainer+peft", "status": "ok", "tokens_per_s": 50000.0, "peak_gib": 24.0}
    assert bench.ratio_notes([kit, peer]) == [
        "GLA-340M kit / Trainer + PEFT: 1.80x tokens/s, peak 20.00 / 24.00 GiB "
        "(meets the 1.5x-at-no-more-memory target)"
    ]
    peer["peak_gib"] = 19.0
    assert "MISSES" in bench.ratio_notes([kit, peer])[0]


def test_bench_ratio_lines_name_the_target():
    bench = load_bench()
    fast = {
        "row": "mamba2-130m lora fast",
        "status": "ok",
        "tokens_per_s": 42000.0,
        "kernel_path": "mamba_ssm",
    }
    reference = {"row": "mamba2-130m lora reference", "status": "ok", "tokens_per_s": 1500.0}
    assert bench.ratio_notes([fast, reference]) == [
        "Mamba-2 fast (mamba_ssm) / reference: 28.0x tokens/s (meets the 20x target)"
    ]
    reference["tokens_per_s"] = 4200.0
    assert "10.0x tokens/s (MISSES the 20x target)" in bench.ratio_notes([fast, reference])[0]
    mamba1 = [
        {**fast, "row": "mamba-130m lora fast", "tokens_per_s": 30000.0},
        {**reference, "row": "mamba-130m lora reference", "tokens_per_s": 6000.0},
    ]
    assert bench.ratio_notes(mamba1) == ["Mamba-1 fast (mamba_ssm) / reference: 5.0x tokens/s"]
    assert bench.ratio_notes([fast]) == []  # no reference row, no ratio


def load_peft_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_peft_methods", REPO / "bench" / "bench_peft_methods.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peft_bench_task_is_a_learnable_sst2_and_configs_differ_only_in_the_method(tmp_path):
    """bench/bench_peft_methods.py: the generated task reads back through the kit's GLUE loader, its label
    word is the training response, and the three runs share everything but the lora method keys."""
    from trainer.config import load_config
    from trainer.tasks.glue import GlueTask

    bench = load_peft_bench()
    glue, train = bench.write_task(tmp_path, 20, 6, seed=0)
    task = GlueTask("sst2", glue)
    examples = task.load("validation")
    assert len(examples) == 6 and {e["label"] for e in examples} == {0, 1}
    records = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(records) == 20 and all(task.parse(r["response"]) in (0, 1) for r in records)
    args = bench.argparse.Namespace(out=tmp_path, steps=10, batch=4, lr=1e-3, r=4, dev=6, seed=1, smoke=False)
    model = bench.write_model(tmp_path, smoke=True)
    sizes = bench.lengths(model, glue, train)
    configs = {
        m: load_config(bench.run_config(args, m, model, True, glue, train, sizes)) for m in bench.METHODS
    }
    assert (configs["sdlora"].lora.method, configs["lora_ga"].lora.init) == ("sdlora", "lora_ga")
    plain = {m: {**c.to_dict(), "paths": None, "lora": None} for m, c in configs.items()}
    assert plain["lora"] == plain["sdlora"] == plain["lora_ga"]


def test_peft_bench_rows_hold_whole_records_and_answers_hold_whole_label_words(tmp_path):
    """The GPU run read sst2 accuracy 0.000 for every method: rows of 64 tokens split each record (the label
    word's window lost the sentence) and 3 new tokens cut ' positive' (6 tokens) short. Both come from the
    tokenizer now: the kit's data pipeline splits no record, and every label word fits."""
    import dataclasses

    from trainer.config import load_config
    from trainer.data.dataset import prepare_data
    from trainer.data.records import Encoder
    from trainer.model.loading import load_tokenizer
    from trainer.tasks.glue import GlueTask
    from trainer.training.task_eval import answer_room

    bench = load_peft_bench()
    glue, train = bench.write_task(tmp_path, 200, 6, seed=3)
    model = bench.write_model(tmp_path, smoke=True)
    sizes = bench.lengths(model, glue, train)
    args = bench.argparse.Namespace(out=tmp_path, steps=2, batch=2, lr=1e-3, r=4, dev=6, seed=1, smoke=True)
    cfg = load_config(bench.run_config(args, "lora", model, True, glue, train, sizes))
    assert cfg.data.max_length == sizes["max_length"] and cfg.eval.max_new_tokens == sizes["max_new_tokens"]
    tokenizer = load_tokenizer(cfg)
    records = [json.loads(line) for line in train.read_text().splitlines()]
    encoded = Encoder(tokenizer, cfg.data, "instruction").encode(records)
    assert 64 < max(len(e.ids) for e in encoded) <= cfg.data.max_length  # 64 split almost every record
    data = dataclasses.replace(cfg.data, packing=False, val_fraction=0.0)
    prepared = prepare_data(cfg.paths, data, tokenizer, family_packing=True)
    assert len(prepared.train) == len(records) and prepared.report.truncation_would_lose_tokens == 0
    assert answer_room(GlueTask("sst2", glue), tokenizer, cfg.eval.max_new_tokens) is None
    assert answer_room(GlueTask("sst2", glue), tokenizer, 3) is not None  # what the GPU run had


@pytest.mark.slow
def test_peft_bench_smoke_generates_label_words_the_evaluation_reads(tmp_path, capsys):
    """A short CPU run of the bench end to end (LoRA only): the evaluation reads every answer (none
    unparsed), so the table's accuracy is a real number, not the 0.000 of answers cut short."""
    bench = load_peft_bench()
    args = ["--out", str(tmp_path), "--smoke", "--methods", "lora", "--steps", "20", "--train-rows", "160"]
    assert bench.main([*args, "--dev", "16"]) == 0
    result = json.loads((tmp_path / "peft_methods.json").read_text())["lora"]
    last = result["eval"][-1]
    assert last["n"] == 16 and last["unparsed"] == 0 and result["final_accuracy"] > 0, result["eval"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| lora |"))
    assert f"| {result['final_accuracy']:.3f} |" in row and "| 0.000 |" not in row


def test_gla_sensitivity_measures_nothing_without_an_error_and_something_with_one(tmp_path):
    """bench/gla_sensitivity.py: the reference against itself is identical; an injected op error shows up in
    the logits and the LoRA gradients (the check would read 0 if the perturbed op were never called)."""
    load_bench()  # gla_sensitivity imports bench_families by name
    spec = importlib.util.spec_from_file_location("gla_sensitivity", REPO / "bench" / "gla_sensitivity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {}
    for eps in (0.0, 1e-2):
        out = tmp_path / f"{eps}.json"
        assert module.main(["--layers", "1", "--seq", "16", "--eps", str(eps), "--out", str(out)]) == 0
        results[eps] = json.loads(out.read_text())
    assert results[0.0]["max_abs_logit_diff"] == 0.0 and results[0.0]["grad_rel_diff"] == 0.0
    assert results[1e-2]["max_abs_logit_diff"] > 0 and 0 < results[1e-2]["grad_rel_diff"] < 1


def test_gla_loss_curve_trains_each_path_and_compares_step_by_step(tmp_path):
    """bench/gla_loss_curve.py on CPU: the reference path against itself trains the same curve (0 apart),
    on the widened model the script builds; the noise floor (the same path in fp32) is a real distance; a run
    stopped before it logged anything is reported, not compared."""
    spec = importlib.util.spec_from_file_location("gla_loss_curve", REPO / "bench" / "gla_loss_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "curve.json"
    common = "--steps 2 --hidden 64 --layers 1 --heads 2 --seq 64 --batch 2".split()
    paths = ["--paths", "fla-naive-torch,fla-naive-torch"]
    assert module.main([*common, *paths, "--noise-floor", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["kernel_path"] for r in result["runs"]] == ["fla-naive-torch"] * 3
    assert all(r["finished"] for r in result["runs"])
    assert result["comparison"]["steps"] == 2 and result["comparison"]["max_abs_diff"] == 0.0
    assert 5 < result["comparison"]["first"][0] < 9  # a random 1024-token model: about ln(1024)
    assert result["noise_floor"]["steps"] == 2 and 0 < result["noise_floor"]["max_abs_diff"] < 0.5
    built = json.loads((Path(result["model"]) / "config.json").read_text())
    assert (built["hidden_size"], built["num_hidden_layers"], built["num_heads"]) == (64, 1, 2)
    assert module.main([*common, *paths, "--timeout", "0.5", "--out", str(out)]) == 1
    assert "comparison" not in json.loads(out.read_text())


def test_gla_attention_mode_switches_every_layer_for_the_block_only():
    """bench_families' fp32 check reruns the model on fused_recurrent_gla (what fp32 runs train through)."""
    from fla.models import GLAConfig, GLAForCausalLM

    bench = load_bench()
    model = GLAForCausalLM(GLAConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=64))
    layers = [m for name, m in model.named_modules() if name.endswith("attn")]
    assert len(layers) == 2 and {layer.mode for layer in layers} == {"chunk"}
    with bench.gla_attention_mode(model, "fused_recurrent"):
        assert {layer.mode for layer in layers} == {"fused_recurrent"}
    assert {layer.mode for layer in layers} == {"chunk"}


def test_a_row_past_its_timeout_is_recorded_and_earlier_rows_are_kept(tmp_path, monkeypatch):
    """``--row-timeout``: a row still running is recorded as a timeout and the next row runs; the JSON is
    written after every row, so a call cut short keeps what finished."""
    import subprocess

    bench = load_bench()
    out = tmp_path / "families.json"
    seen = []

    def fake_run(child, **kwargs):
        row = child[-1]
        seen.append((row, kwargs.get("timeout")))
        if row.endswith("dora fast"):
            raise subprocess.TimeoutExpired(child, kwargs["timeout"], stderr=b"autotuning...")
        if len(seen) > 1:  # the rows before were written already
            assert [r["row"] for r in json.loads(out.read_text())["rows"]] == [s[0] for s in seen[:-1]]
        result = {"row": row, "status": "ok", "tokens_per_s": 1.0, "kernel_path": "mamba_ssm", "seq": 64,
                  "total_params_m": 1, "batch": 2, "peak_gib": None}  # fmt: skip
        return subprocess.CompletedProcess(child, 0, stdout="ROW-RESULT " + json.dumps(result), stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = ["--only", "mamba2-130m", "--row-timeout", "7", "--out", str(out)]
    assert bench.main(args) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6 and all(timeout == 7 for _, timeout in seen)
    assert rows["mamba2-130m dora fast"] == {
        "row": "mamba2-130m dora fast", "status": "timeout", "reason": "still running after 7 s"
    }  # fmt: skip
    assert rows["mamba2-130m qlora reference"]["status"] == "ok"


def test_autotune_limit_keeps_the_first_configs_after_the_kernels_own_pruning():
    bench = load_bench()

    class Autotuner:  # the shape of triton.runtime.autotuner.Autotuner's hook
        def __init__(self, configs):
            self.configs = configs

        def prune_configs(self, kwargs):
            return [c for c in self.configs if c != "bad"]

    tuner = Autotuner(["bad", "a", "b", "c"])
    bench.limit_autotuning(2, Autotuner)
    assert tuner.prune_configs({}) == ["a", "b"]
    bench.limit_autotuning(1, Autotuner)  # set again: replaces the limit, never stacks
    assert tuner.prune_configs({}) == ["a"]


def test_fp64_reference_op_matches_the_fp32_one_and_keeps_the_dtype():
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from trainer.families.gla_reference import naive_gla

    bench = load_bench()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g) for _ in range(3))
    gk = -torch.rand(1, 16, 2, 8, generator=g)
    exact, state = bench.naive_gla_in_fp64(q=q, k=k, v=v, gk=gk, output_final_state=True)
    plain, plain_state = naive_gla(q=q, k=k, v=v, gk=gk, output_final_state=True)
    assert exact.dtype == state.dtype == torch.float32
    assert torch.allclose(exact, plain, atol=1e-5) and torch.allclose(state, plain_state, atol=1e-5)
    assert not torch.equal(exact, plain)  # computed in fp64, not the fp32 op again
