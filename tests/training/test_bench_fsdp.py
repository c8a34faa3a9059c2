"""bench/bench_fsdp_gpu.py (a GPU benchmark) keeps working: each cell lands in report.json as it finishes, a
budget skips what would not fit a GPU call, and on CPU processes (--smoke) the memory section runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, trainer_env


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_fsdp_gpu", REPO / "bench" / "bench_fsdp_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fsdp_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_cells_land_in_the_report_one_by_one_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    bench = load_bench()
    args = bench.argparse.Namespace(gpus=[1, 2], methods=["qlora"], smoke=False, steps=4, length=64, port=0)
    args.modes = ["ddp", "fsdp", "ddp+fast"]
    models = {"dense": (tmp_path, 8, 32), "glm_air": (tmp_path, 3, 46)}
    assert bench.memory_cells(args, models) == [
        ("dense", "qlora", "ddp", 1), ("dense", "qlora", "fsdp", 2),
        ("glm_air", "qlora", "ddp", 1), ("glm_air", "qlora", "fsdp", 2),
        ("dense", "qlora", "ddp", 2), ("glm_air", "qlora", "ddp", 2),
        ("dense", "qlora", "ddp+fast", 1), ("glm_air", "qlora", "ddp+fast", 1),
        ("dense", "qlora", "ddp+fast", 2), ("glm_air", "qlora", "ddp+fast", 2),
    ]  # fmt: skip
    fast = bench.argparse.Namespace(
        **{**vars(args), "gpus": [2], "methods": ["lora"], "modes": ["fsdp+fast", "ddp+fast"]}
    )
    assert bench.memory_cells(fast, {"dense": models["dense"]}) == [
        ("dense", "lora", "fsdp+fast", 2), ("dense", "lora", "ddp+fast", 2),
    ]  # fmt: skip
    only_ddp_fast = bench.argparse.Namespace(**{**vars(fast), "modes": ["ddp+fast"]})
    assert bench.memory_cells(only_ddp_fast, {"dense": models["dense"]}) == [("dense", "lora", "ddp+fast", 2)]
    only_fsdp = bench.argparse.Namespace(**{**vars(args), "gpus": [2, 4], "modes": ["fsdp"]})
    assert bench.memory_cells(only_fsdp, models) == [
        ("dense", "qlora", "fsdp", 2), ("dense", "qlora", "fsdp", 4),
        ("glm_air", "qlora", "fsdp", 2), ("glm_air", "qlora", "fsdp", 4),
    ]  # fmt: skip

    report = bench.Report(tmp_path / "report.json", args)
    seen = []

    def fake_train(config, gpus, args):
        seen.append(json.loads((tmp_path / "report.json").read_text()).get("memory", []))
        args.budget.seconds = 1e-9 if len(seen) == 2 else args.budget.seconds  # the budget runs out
        return subprocess.CompletedProcess([], 1, "", "boom")

    monkeypatch.setattr(bench, "train", fake_train)
    monkeypatch.setattr(bench, "layer_params", lambda folder: 1000)
    args.budget = bench.Budget(3600)
    bench.memory(args, models, tmp_path / "out", report)
    assert [len(rows) for rows in seen] == [0, 1]  # the first cell was in the file before the second started
    rows = json.loads((tmp_path / "report.json").read_text())["memory"]
    assert [r["status"] for r in rows] == ["failed (1)"] * 2 + ["skipped (budget)"] * 8
    assert rows[1]["mode"] == "fsdp" and rows[1]["gpus"] == 2


@pytest.mark.slow
def test_smoke_runs_ddp_and_fsdp_on_two_cpu_processes(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "bench/bench_fsdp_gpu.py", "--smoke", "--out", str(out), "--only", "memory",
               "--models", "dense", "--gpus", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((out / "report.json").read_text())["memory"]
    assert [(r["mode"], r["gpus"], r["status"]) for r in rows] == [("fsdp", 2, "ok"), ("ddp", 2, "ok")]
    assert rows[0]["params_mib_max_rank"] > 0 and rows[0]["tokens_per_s_per_gpu"] > 0
    assert (out / "models" / "dense8b" / "model.safetensors").is_file()  # built once, loaded by every cell


def test_planner_section_predicts_each_fsdp_cell_and_reads_it_against_the_measured_peak(tmp_path):
    """The planner's one-device dry run (`python -m trainer plan --gpus 2`, a real CPU process at toy size)
    against the memory section's FSDP row for the same model and GPU count."""
    bench = load_bench()
    args = bench.argparse.Namespace(
        gpus=[1, 2], smoke=True, steps=2, length=64, port=0, budget=bench.Budget(600), methods=["qlora"]
    )
    folder = bench.write_model(tmp_path / "models" / "dense8b", bench.DENSE_8B, 2, smoke=True)
    report = bench.Report(tmp_path / "report.json", args)
    report.add("memory", {"model": "dense", "method": "qlora", "mode": "fsdp", "gpus": 2, "peak_gib": 0.25})
    bench.planner(args, {"dense": (folder, 2, 32)}, tmp_path, report)
    (row,) = json.loads((tmp_path / "report.json").read_text())["planner"]
    assert (
        row["status"] == "ok"
        and row["gpus"] == 2
        and row["method"] == "qlora"
        and row["measured_gib"] == 0.25
    )
    assert row["predicted_gib"] > 0
    assert row["predicted_over_measured"] == round(row["predicted_gib"] / 0.25, 2)
    plan = json.loads((tmp_path / "planner" / "dense-qlora-2" / "plan.json").read_text())
    assert any(c["fsdp_gpus"] == 2 and c["micro"] == 1 for c in plan["candidates"])


def test_planner_section_records_a_dry_run_the_budget_stopped(tmp_path, monkeypatch):
    bench = load_bench()
    args = bench.argparse.Namespace(
        gpus=[2], smoke=True, steps=2, length=64, port=0, budget=bench.Budget(600), methods=["qlora"]
    )
    report = bench.Report(tmp_path / "report.json", args)

    def out_of_time(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(bench.subprocess, "run", out_of_time)
    bench.planner(args, {"dense": (tmp_path, 2, 32)}, tmp_path, report)
    (row,) = json.loads((tmp_path / "report.json").read_text())["planner"]
    assert row["status"] == "timeout (budget)" and row["gpus"] == 2


def test_full_model_figure_counts_what_each_method_keeps_per_left_out_parameter():
    """QLoRA's left-out layers add their NF4 bytes; full fine-tuning adds weights, gradients and AdamW's
    moments: bf16 under DDP, fp32 masters under FSDP (divided among the GPUs)."""
    bench = load_bench()
    gib = 2**30  # parameters in one layer: the layer left out adds 1 GiB per byte each parameter keeps
    row = {"layers": 4, "peak_gib": 1.0}
    assert bench.full_model_gib({**row, "method": "qlora", "mode": "ddp", "gpus": 1}, gib, 5) == 1.5
    assert bench.full_model_gib({**row, "method": "full", "mode": "ddp", "gpus": 2}, gib, 5) == 9.0
    assert bench.full_model_gib({**row, "method": "full", "mode": "fsdp", "gpus": 4}, gib, 5) == 5.0
    assert (
        bench.full_model_gib({**row, "method": "lora", "mode": "fsdp", "gpus": 2, "peak_gib": None}, gib, 5)
        is None
    )


def test_cells_take_the_optimizer_and_bad_modes_are_refused(tmp_path, capsys):
    bench = load_bench()
    args = bench.argparse.Namespace(smoke=False, steps=4, length=64, optimizer="adamw_8bit")
    config = bench.cell_config(tmp_path / "cell", tmp_path, "full", "fsdp", 2, args)
    assert bench.yaml.safe_load(config.read_text())["optimization"]["optimizer"] == "adamw_8bit"
    assert "fsdp" not in bench.yaml.safe_load(config.read_text())  # the config's own forward_prefetch
    args.forward_prefetch = 0
    config = bench.cell_config(tmp_path / "cell", tmp_path, "lora", "fsdp", 2, args)
    assert bench.yaml.safe_load(config.read_text())["fsdp"] == {"forward_prefetch": 0}
    config = bench.cell_config(tmp_path / "ddp", tmp_path, "lora", "ddp", 2, args)
    assert "fsdp" not in bench.yaml.safe_load(config.read_text())
    assert bench.yaml.safe_load(config.read_text())["performance"]["cuda_graphs"] == "auto"
    args.cuda_graphs = "on"  # --cuda-graphs on: DDP cells replay their layers
    config = bench.cell_config(tmp_path / "ddp", tmp_path, "lora", "ddp", 2, args)
    assert bench.yaml.safe_load(config.read_text())["performance"]["cuda_graphs"] == "on"
    config = bench.cell_config(tmp_path / "cell", tmp_path, "lora", "fsdp", 2, args)
    assert bench.yaml.safe_load(config.read_text())["performance"]["cuda_graphs"] == "auto"
    assert bench.yaml.safe_load(config.read_text())["memory"]["gradient_checkpointing"] is True
    args.no_checkpointing = True  # --no-checkpointing: DDP + fast replays its whole stack
    config = bench.cell_config(tmp_path / "cell", tmp_path, "lora", "ddp", 2, args)
    assert bench.yaml.safe_load(config.read_text())["memory"]["gradient_checkpointing"] is False
    with pytest.raises(SystemExit) as info:
        bench.main(["--out", str(tmp_path / "out"), "--gpus", "2", "--modes", "fsdp,zero3"])
    assert info.value.code == 2
    assert "--modes: unknown ['zero3']; expected ddp, fsdp, ddp+fast or fsdp+fast" in capsys.readouterr().err


def test_the_planner_reads_measured_peaks_from_an_earlier_report(tmp_path):
    bench = load_bench()
    row = {"model": "dense", "method": "lora", "mode": "fsdp", "gpus": 2, "peak_gib": 5.87}
    (tmp_path / "earlier.json").write_text(json.dumps({"args": {}, "memory": [row]}))
    assert bench.earlier_memory_rows(tmp_path / "earlier.json") == [row]


def test_all_gather_bandwidth_bench_runs_on_two_cpu_processes():
    """bench/collectives_gpu.py (the link FSDP's gathers cross) on gloo: one row per size, positive figures."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "bench/collectives_gpu.py", "--cpu", "--sizes-mb", "1,2", "--iters", "2"]  # fmt: skip
    env = {**trainer_env(), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["mb"] for r in rows] == [1.0, 2.0] and all(r["ms"] > 0 and r["world"] == 2 for r in rows)
    assert "all-gather, 2 ranks, cpu (gloo)" in result.stdout


def test_the_fast_path_column_says_whether_the_layers_replayed_from_graphs_and_why_not(tmp_path):
    bench = load_bench()
    logs = tmp_path / "logs"
    logs.mkdir()
    report = {"event": "model_report", "fast_path": {"enabled": True, "lora_modules_fused": 32,
              "fused_loss": True, "cuda_graphs": "layers"}}  # fmt: skip
    events = [report, {"event": "cuda_graphs", "state": "replaying", "detail": "hidden states 1x2048x4096"}]
    (logs / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert bench.fast_path_ran(tmp_path) == (
        "on: 32 LoRA nodes, fused loss True, graphs replaying: hidden states 1x2048x4096"
    )
    events.append({"event": "cuda_graphs", "state": "off", "detail": "capturing layer failed: RuntimeError"})
    (logs / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert bench.fast_path_ran(tmp_path).endswith("graphs off: capturing layer failed: RuntimeError")
    report["fast_path"]["cuda_graphs"] = "off: 2 processes: several processes replay graphs only with on"
    (logs / "events.jsonl").write_text(json.dumps(report) + "\n")
    assert bench.fast_path_ran(tmp_path).endswith(
        "graphs off: 2 processes: several processes replay graphs only with on"
    )


def test_fast_equality_judges_fsdp_against_one_gpus_fast_path_beside_the_noise_floor(tmp_path, monkeypatch):
    """Issue 31's loss check under FSDP: each method's FSDP + fast cell against one GPU's fast path over the same
    rows, beside one GPU's fast path against its reference path; a one-GPU cell that fails skips its FSDP cell."""
    bench = load_bench()
    args = bench.argparse.Namespace(
        gpus=[1, 2], methods=["lora", "qlora"], smoke=False, steps=3, length=64, port=0
    )
    args.budget = bench.Budget(3600)
    losses = {
        "dense-lora-1-fast-on": [2.0, 1.5, 1.25],
        "dense-lora-1-fast-off": [2.0, 1.5, 1.2],
        "dense-lora-fsdp-2": [2.01, 1.5, 1.25],
    }
    configs = []

    def fake_train(config, gpus, args):
        cfg = bench.yaml.safe_load(config.read_text())
        configs.append((config.stem, gpus, cfg["training"]["distributed"], cfg["performance"]["fast_path"]))
        return subprocess.CompletedProcess([], 0 if config.stem in losses else 1, "", "boom")

    monkeypatch.setattr(bench, "train", fake_train)
    monkeypatch.setattr(
        bench, "figures", lambda run, gpus: {"losses": losses[run.name], "fast_path": "on: 4 nodes"}
    )
    report = bench.Report(tmp_path / "report.json", args)
    bench.fast_equality(args, {"dense": (tmp_path, 8, 32)}, tmp_path / "out", report)

    assert configs == [
        ("dense-lora-1-fast-on", 1, "ddp", "on"), ("dense-lora-1-fast-off", 1, "ddp", "off"),
        ("dense-lora-fsdp-2", 2, "fsdp", "on"), ("dense-qlora-1-fast-on", 1, "ddp", "on"),
    ]  # fmt: skip
    rows = json.loads((tmp_path / "report.json").read_text())["fast_equality"]
    assert rows[0]["method"] == "lora" and rows[0]["gpus"] == 2 and rows[0]["steps"] == 3
    assert rows[0]["max_abs_loss_diff"] == pytest.approx(0.01) and rows[0]["noise_floor"] == pytest.approx(
        0.05
    )
    assert rows[0]["status"] == "ok" and rows[0]["fast_path"] == "on: 4 nodes"
    assert rows[1]["method"] == "qlora" and rows[1]["status"] == "fast path on: failed (1)"
    assert len(rows) == 2
