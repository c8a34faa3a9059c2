"""bench/bench_core_gpu.py, bench/optimizer_state.py and bench/hf_trainer_baseline.py on CPU: the repeat
aggregation and the table it prints, the order runs alternate in, the glm row against Trainer + PEFT, the
resume comparison and the optimizer-state check (the GPU runs only change sizes and the optimizer's device)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from bench import optimizer_state
from tests.helpers import REPO


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load("bench_core_gpu")
baseline = load("hf_trainer_baseline")


def row(tokens, peak=3.0):
    return {"tokens_per_sec": tokens, "peak_gib": peak}


def test_one_repeat_reports_the_run_as_it_is_and_prints_no_range():
    run = {**row(47_000.0, 3.81), "name": "llama lora+gc", "losses": [12.1, 11.9]}
    assert bench.aggregate_runs([run]) is run
    cell = {"shape": "llama", "setting": "lora+gc", "ours": run, "unsloth": row(50_000.0, 3.65)}
    header, line = bench.table_lines([cell])
    assert header.split()[-5:] == ["ours/unsloth", "ours/liger", "ours/hf", "mem/unsloth", "graphs"]
    assert line.split()[-5:] == ["0.94x", "-", "-", "1.04x", "-"]


def test_repeats_give_median_tokens_max_peak_and_the_range_of_paired_ratios():
    ours = bench.aggregate_runs([row(100.0, 3.0), row(120.0, 3.2), row(90.0, 3.1)])
    unsloth = bench.aggregate_runs([row(100.0, 2.0), row(100.0, 2.0), row(120.0, 2.1)])
    assert ours["tokens_per_sec"] == 100.0 and ours["peak_gib"] == 3.2
    assert ours["tokens_per_sec_runs"] == [100.0, 120.0, 90.0] and ours["repeats"] == 3
    assert len(ours["runs"]) == 3
    assert bench.paired_ratio_range(ours, unsloth) == (0.75, 1.2)  # 100/100, 120/100, 90/120
    assert bench.format_ratio(ours, unsloth, with_range=True) == "1.00x 0.75-1.20"
    assert bench.format_ratio(ours, unsloth) == "1.00x"  # other columns: the ratio of medians alone
    lines = bench.table_lines([{"shape": "llama", "setting": "lora", "ours": ours, "unsloth": unsloth}])
    assert "1.00x 0.75-1.20" in lines[1]
    assert lines[2].startswith("ours/unsloth: ratio of median tokens/s, then min-max")


def test_a_failed_repeat_is_left_out_of_the_median_and_reported():
    ours = bench.aggregate_runs([row(100.0), {"name": "x", "error": "CUDA out of memory"}, row(80.0)])
    unsloth = bench.aggregate_runs([row(100.0), row(100.0), row(100.0)])
    assert ours["tokens_per_sec"] == 90.0 and ours["tokens_per_sec_runs"] == [100.0, None, 80.0]
    assert bench.paired_ratio_range(ours, unsloth) == (0.8, 1.0)  # the failed repeat pairs with nothing
    lines = bench.table_lines([{"shape": "qwen3", "setting": "lora", "ours": ours, "unsloth": unsloth}])
    assert "ERROR qwen3 lora ours: CUDA out of memory" in lines
    failed = bench.aggregate_runs([{"error": "a"}, {"error": "b"}])
    assert failed["error"] == "b" and failed["tokens_per_sec_runs"] == [None, None]


def test_the_kit_without_graphs_alternates_with_the_kit_and_its_ratio_is_printed(recorded, tmp_path):
    """``--impl ours,nographs``: each repeat runs the kit, then the kit with performance.cuda_graphs: off, per
    setting, so host drift hits both; the table's last column is ours / nographs."""
    overrides, record = [], bench.run_ours
    bench.run_ours = lambda *args, **extra: overrides.append(extra) or record(*args, **extra)
    cells = bench.measure(tmp_path, "llama", {"ours", "nographs"}, 12, None, repeat=2, settings=("lora+gc",))
    assert [c[1] for c in recorded] == [
        "llama lora+gc", "llama lora+gc nographs", "llama lora+gc r2", "llama lora+gc nographs r2"
    ]  # fmt: skip
    assert overrides == [{}, {"performance.cuda_graphs": "off"}] * 2
    overrides.clear()  # --profile-from: every kit run profiles
    bench.measure(
        tmp_path, "llama", {"ours", "nographs"}, 12, None, settings=("lora",), kit_overrides={"a.b": 6}
    )
    assert overrides == [{"a.b": 6}, {"a.b": 6, "performance.cuda_graphs": "off"}]
    assert bench.parse_args(["--profile-from", "6"]).profile_from == 6
    assert cells[0]["nographs"]["tokens_per_sec_runs"] == [102.0, 104.0]
    line = bench.table_lines(cells)[1]
    assert line.split()[-1] == f"{102.0 / 103.0:.2f}x"  # median 102 (101, 103) over median 103 (102, 104)


def test_a_kit_row_whose_graphs_never_replayed_is_flagged():
    """A run planned for CUDA graphs (model report) that never printed their replay line gets a NOTE, so a row
    measured without them is not read as one with them."""
    quiet = {
        **row(100.0),
        "cuda_graphs": "layers",
        "graphs_replayed": False,
        "graphs_off": "WARNING: capture failed",
    }
    fine = {**row(120.0), "cuda_graphs": "layers", "graphs_replayed": True}
    lines = bench.table_lines(
        [{"shape": "llama", "setting": "lora+gc", "ours": bench.aggregate_runs([quiet, fine])}]
    )
    assert (
        lines[-1] == "NOTE llama lora+gc ours: CUDA graphs planned, never replayed (WARNING: capture failed)"
    )
    assert not any(
        "NOTE" in line for line in bench.table_lines([{"shape": "llama", "setting": "lora", "ours": fine}])
    )


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """The runners replaced by ones that record the order of calls and return figures 100, 101, ..."""
    calls = []

    def run_ours(root, name, model, method, steps, gc, targets, **extra):
        calls.append(("ours", name, tuple(targets), extra.get("fast_path")))
        return row(100.0 + len(calls))

    def run_hf(model, steps, quantize, checkpointing, liger, targets=None):
        calls.append(("liger" if liger else "hf", quantize, checkpointing, targets and tuple(targets)))
        return row(50.0)

    def run_unsloth(anchors, steps, model=None, settings=tuple(bench.SETTINGS)):
        calls.append(("unsloth", *settings))
        return {setting: row(200.0 + len(calls)) for setting in settings}

    monkeypatch.setattr(bench, "model_dir", lambda *a, **k: tmp_path)
    monkeypatch.setattr(bench, "run_ours", run_ours)
    monkeypatch.setattr(bench, "run_hf", run_hf)
    monkeypatch.setattr(bench, "run_unsloth", run_unsloth)
    return calls


def test_repeats_alternate_every_kit_setting_with_one_unsloth_call(recorded, tmp_path):
    impls = {"ours", "ref", "liger", "unsloth"}
    saved = []  # what main's progress writes to the JSON file after each repeat

    def progress(cells):
        saved.append(json.loads(json.dumps(cells)))

    cells = bench.measure(tmp_path, "llama", impls, 12, tmp_path, repeat=2, progress=progress)
    order = [c[0] if c[0] != "ours" else c[1] for c in recorded]
    assert recorded[-1] == ("unsloth", *bench.SETTINGS)
    assert order == [
        "llama lora+gc",
        "llama lora+gc ref",
        "liger",
        "llama qlora+gc",
        "llama qlora+gc ref",
        "liger",
        "llama lora",
        "llama lora ref",
        "liger",
        "unsloth",
        "llama lora+gc r2",  # second repeat: the kit and Unsloth only
        "llama qlora+gc r2",
        "llama lora r2",
        "unsloth",
    ]
    first = cells[0]
    assert first["ours"]["tokens_per_sec_runs"] == [101.0, 111.0]
    assert first["unsloth"]["tokens_per_sec_runs"] == [210.0, 214.0]
    assert "tokens_per_sec_runs" not in first["ref"] and "tokens_per_sec_runs" not in first["liger"]
    # saved after each setting of the first repeat (a call cut off during Unsloth keeps the rows before
    # it: the third save has every kit, ref and Liger row, no Unsloth yet), then after each repeat
    assert len(saved) == 5
    assert [("ours" in c, "unsloth" in c) for c in saved[0]] == [
        (True, False),
        (False, False),
        (False, False),
    ]
    assert all("ours" in c and "liger" in c and "unsloth" not in c for c in saved[2])
    assert saved[3][0]["ours"]["tokens_per_sec"] == 101.0 and "unsloth" in saved[3][0]  # after repeat 1


def test_settings_pick_the_cells_and_the_unsloth_variants(recorded, tmp_path):
    """``--settings qlora+gc`` repeats one setting: the kit's runs and Unsloth's variant for it alone."""
    cells = bench.measure(
        tmp_path, "llama", {"ours", "unsloth"}, 12, tmp_path, repeat=2, settings=("qlora+gc",)
    )
    assert [c["setting"] for c in cells] == ["qlora+gc"]
    assert recorded == [
        ("ours", "llama qlora+gc", tuple(bench.ALL_LINEAR), None),
        ("unsloth", "qlora+gc"),
        ("ours", "llama qlora+gc r2", tuple(bench.ALL_LINEAR), None),
        ("unsloth", "qlora+gc"),
    ]
    assert bench.parse_args(["--settings", "qlora+gc,lora"]).settings == ["qlora+gc", "lora"]


def test_unsloth_runs_only_the_variants_of_the_settings_asked_for(tmp_path, monkeypatch):
    seen = {}

    def fake_run(command, cwd, capture_output, text, env, timeout):
        seen["only"] = env["ONLY"]
        line = 'RESULT {"name": "unsloth-qlora-nf4", "tokens_per_s": 5.0, "peak_gib": 1.0}'
        return bench.subprocess.CompletedProcess(command, 0, line, "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    rows = bench.run_unsloth(tmp_path, 3, settings=("qlora+gc",))
    assert seen["only"] == "unsloth-qlora-nf4" and rows["qlora+gc"]["tokens_per_sec"] == 5.0


def test_glm_row_runs_trainer_peft_on_the_attention_projections_and_prints_the_ratio(recorded, tmp_path):
    cell = bench.measure_glm(tmp_path, {"ours", "ref", "hf", "liger", "unsloth"}, 12)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert recorded == [
        ("ours", "glm qlora+gc", attention, None),
        ("ours", "glm qlora+gc ref", attention, "off"),
        ("hf", True, True, attention),  # QLoRA, checkpointing, the same four targets
    ]
    assert set(cell) == {"shape", "setting", "ours", "ref", "hf"}
    line = bench.table_lines([cell])[1]
    assert line.split()[-5:] == ["-", "-", "2.02x", "-", "-"]  # ours/hf: 101 / 50
    assert bench.quantization_note(cell) is None
    cell["ours"].update(quantized_params=539e6, total_params=606e6)
    note = "2.00 GiB of fused MoE expert weights are not 4-bit"
    cell["hf"].update(quantized_params=36e6, total_params=606e6, unquantized_expert_bytes=2 << 30, note=note)
    assert bench.quantization_note(cell) == (
        "NOTE glm qlora+gc: ours 539M of 606M params in 4-bit; hf 36M of 606M params in 4-bit; hf: " + note
    )
    cell["ours"]["moe_experts_grouped"] = 5  # the fast path's grouped 4-bit experts, from the model report
    assert "; ours: 5 experts modules on grouped GEMMs; hf: " in bench.quantization_note(cell)


def test_resumed_losses_compare_over_the_steps_both_runs_logged():
    straight = {step: 2.0 + step / 100 for step in range(1, 21)}
    resumed = {**straight, 12: straight[12] + 3e-4, 15: straight[15] - 7e-4}
    del resumed[20]
    compared, worst = bench.max_loss_diff(straight, resumed, range(11, 21))
    assert compared == 9 and worst == pytest.approx(7e-4)
    assert bench.max_loss_diff(straight, {}, range(11, 21)) == (0, None)


def test_losses_by_step_keeps_the_last_record_of_a_replayed_step(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"step": 2, "loss": 2.8}]
    (logs / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench.losses_by_step(tmp_path) == {1: 3.0, 2: 2.8}


def saved_optimizer(tmp_path, name: str, steps: int = 2):
    """An optimizer of the kit's class for ``name`` after a few steps on two LoRA-shaped tensors and a bias,
    saved as accelerate's save_state does (torch.save of its state_dict)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 4096)), torch.nn.Parameter(torch.randn(512, 16))]
    bias = torch.nn.Parameter(torch.randn(8))
    groups = [{"params": params, "weight_decay": 0.01}, {"params": [bias], "weight_decay": 0.0}]
    optimizer = optimizer_state.optimizer_class(name)(groups, lr=1e-3)
    for _ in range(steps):
        for p in (*params, bias):
            p.grad = torch.randn_like(p)
        optimizer.step()
    path = tmp_path / "optimizer.bin"
    torch.save(optimizer.state_dict(), path)
    return path


def test_adamw_state_loads_back_identical_with_state_for_every_parameter(tmp_path):
    check = optimizer_state.optimizer_state_check(
        saved_optimizer(tmp_path, "adamw"), "adamw", 3, device="cpu"
    )
    assert check["every_param_has_state"] and check["identical_after_load"], check
    assert check["param_groups"] == [2, 1] and check["class"] == "AdamW"
    assert check["params_with_8bit_state"] == 0


def test_state_check_notices_missing_parameters_and_altered_state(tmp_path):
    path = saved_optimizer(tmp_path, "adamw")
    assert not optimizer_state.optimizer_state_check(path, "adamw", 4, device="cpu")["every_param_has_state"]
    # fp32 moments put into bf16 parameters come back rounded: the comparison is exact, dtype included
    altered = optimizer_state.optimizer_state_check(path, "adamw", 3, dtype=torch.bfloat16, device="cpu")
    assert not altered["identical_after_load"] and "0:exp_avg" in altered["differing"]
    state = torch.load(path)
    del state["state"][1]
    torch.save(state, path)
    missing = optimizer_state.optimizer_state_check(path, "adamw", 3, device="cpu")
    assert missing["error"] == "no exp_avg or state1 in the saved state of parameter 1"


def test_8bit_adamw_state_is_8bit_and_loads_back_identical(tmp_path):
    pytest.importorskip("bitsandbytes")
    path = saved_optimizer(tmp_path, "adamw_8bit")
    check = optimizer_state.optimizer_state_check(path, "adamw_8bit", 3, device="cpu")
    assert check["class"] == "AdamW8bit"
    assert check["every_param_has_state"] and check["identical_after_load"], check
    assert check["params_with_8bit_state"] == 2  # the 8-bit state needs 4096+ elements: not the bias
    assert check["paged_tensors_after_load"] == 0 and check["fresh_state_paged"] is False


def test_arguments_are_checked_with_one_line_naming_the_bad_value(capsys):
    args = bench.parse_args([])
    assert (args.repeat, args.only, args.optimizer_check) == (1, ["llama"], [])
    args = bench.parse_args(["--repeat", "3", "--only", "qwen3,glm", "--optimizer-check", "adamw_8bit"])
    assert (args.repeat, args.only, args.optimizer_check) == (3, ["qwen3", "glm"], ["adamw_8bit"])
    assert bench.parse_args(["--only", "", "--loss-steps", "200"]).only == []  # the checks alone
    for argv, message in (
        (["--optimizer-check", "adamw_8bit,sgd"], "optimizer 'sgd': expected adamw, adamw_8bit"),
        (["--repeat", "0"], "'0': expected a whole number of at least 1"),
        (["--only", "mistral"], "shape 'mistral': expected llama, qwen3, glm"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_trainer_baseline_leaves_fused_glm_experts_unquantized_and_says_so(tmp_path):
    """transformers' bitsandbytes path replaces nn.Linear only: glm4_moe's fused 3-D experts stay out of
    4-bit, and PEFT's k-bit preparation upcasts them to fp32; LoRA goes on the given targets only."""
    pytest.importorskip("bitsandbytes")
    small = {
        **bench.GLM_SMALL,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 1024,
    }
    (tmp_path / "config.json").write_text(json.dumps(small))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "configs" / "tiny-moe" / name, tmp_path / name)
    attention = bench.ATTENTION
    model = baseline.build_model(str(tmp_path), True, True, attention, {"": "cpu"})
    trained = {
        n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad
    }
    assert trained == set(attention)
    report = baseline.quantization_report(model, True)
    experts = 8 * (2 * 32 * 64 + 64 * 32)  # gate_up_proj and down_proj of the one MoE layer
    assert report["unquantized_expert_bytes"] == experts * 4  # fp32 after prepare_model_for_kbit_training
    assert report["quantized_params"] > 0 and report["total_params"] > report["quantized_params"] + experts
    assert "fused MoE expert weights are not 4-bit" in report["note"]
    assert baseline.target_list("q_proj, v_proj") == ["q_proj", "v_proj"]


@pytest.mark.slow
def test_resume_check_kills_resumes_and_reads_the_checkpoint_optimizer_state(tmp_path):
    """The harness against the kit's real run folder and checkpoint layout, on CPU (where resume is exact)."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(REPO / "configs" / "tiny-llama", model)
    cpu = {"data.max_length": 128, "training.mixed_precision": "no"}
    result = bench.resume_check(tmp_path, steps=12, kill_after=4, model=model, extra=cpu)
    assert "error" not in result, result
    assert result["optimizer"] == "adamw" and result["killed_after_step"] >= 4
    assert result["resumed_from_step"] == 4 and not result["first_run_finished_before_kill"]
    assert result["compared_steps"] == 8 and result["max_abs_diff"] == 0.0
    state = result["optimizer_state"]
    assert state["every_param_has_state"] and state["identical_after_load"], state
    assert state["expected_params"] == 2 * 2 * 7  # lora_A and lora_B on seven projections, two layers


def test_a_run_of_ours_past_its_timeout_is_a_row_with_the_error(tmp_path, monkeypatch):
    """A setting that hangs must not lose the call's other rows: it comes back as a row saying so."""
    import subprocess

    seen = {}

    def run_child(command, timeout=None, cwd=None, env=None):
        seen.update(command=command, timeout=timeout)
        return subprocess.CompletedProcess(command, bench.harness.TIMED_OUT, "", "step 3 of 20\n")

    monkeypatch.setattr(bench.harness, "run_child", run_child)
    monkeypatch.setattr(bench, "trainer_config", lambda out, *a, **k: tmp_path / "config.yaml")
    got = bench.run_ours(tmp_path, "llama lora+gc", tmp_path, "lora", 20, True, None, timeout=5)
    assert seen["timeout"] == 5 and seen["command"][-2:] == ["--config", str(tmp_path / "config.yaml")]
    assert got["impl"] == "ours" and got["name"] == "llama lora+gc"
    assert got["error"].startswith("timed out after 5 s") and "step 3 of 20" in got["error"]


def test_the_loss_check_compares_graphs_eager_plain_checkpointing_and_the_reference(monkeypatch, tmp_path):
    """``--loss-steps``: the fast path with graphs, without them, and (checkpointed settings) with the layer
    inputs kept on the device, each against the reference path: which one parts from it says where a fault is."""
    losses = {"fast": [3.0, 2.0], "eager": [3.0, 2.01], "plain": [3.0, 2.002], "ref": [3.0, 2.001]}
    asked = []

    def run_ours(root, name, model, method, steps, gc, targets, **extra):
        asked.append((name, gc, extra))
        return {"losses": losses[name.split()[-1]], "graphs_replayed": True, "fast_path": True}

    monkeypatch.setattr(bench, "model_dir", lambda *a, **k: tmp_path)
    monkeypatch.setattr(bench, "run_ours", run_ours)
    result = bench.loss_check(tmp_path, 2, "lora+gc")
    quiet = {"eval.interval": 10_000}
    assert asked == [
        ("loss fast", True, quiet),
        ("loss eager", True, {**quiet, "performance.cuda_graphs": "off"}),
        ("loss plain", True, {**quiet, "memory.offload_checkpoints": False}),
        ("loss ref", True, {"fast_path": "off"}),
    ]
    assert result["max_abs_diff"] == pytest.approx(0.001) and result["graphs_vs_eager_max_abs_diff"] == 0.01
    assert result["eager_vs_ref_max_abs_diff"] == 0.009 and result["plain_vs_ref_max_abs_diff"] == 0.001
    assert result["plain_vs_eager_max_abs_diff"] == 0.008 and result["plain_losses"] == [3.0, 2.002]
    asked.clear()  # without checkpointing there is nothing to offload: no plain run
    assert "plain_vs_ref_max_abs_diff" not in bench.loss_check(tmp_path, 2, "lora") and len(asked) == 3
    asked.clear()  # QLoRA: also the reference in the fast path's precision
    losses["ref16"] = [3.0, 2.0005]
    result = bench.loss_check(tmp_path, 2, "qlora+gc")
    assert asked[-1] == ("loss ref16", True, {"fast_path": "off", "quantization.upcast": "off"})
    assert result["fast_vs_ref16_max_abs_diff"] == 0.0005 and result["ref16_vs_ref_max_abs_diff"] == 0.0005
