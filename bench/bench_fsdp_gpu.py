"""FSDP2 against DDP on 1, 2 and 4 GPUs: per-GPU peak memory, tokens/s, loss equality, exact resume.

Offline: the models are random-initialised from configs written here (no download), with the layer shapes of
a dense 8B (Llama-3-8B) and of GLM-4.5-Air (glm4_moe), and fewer layers; the per-GPU figure of the full
model follows from the per-layer one (printed as "per layer"). The random weights are written once per model
(on a GPU when there is one) and every cell loads them. Every cell is a real `python -m trainer train`
(under `accelerate launch` for several GPUs) whose run folder gives the numbers: rank 0's peak allocated
memory (training_log.jsonl `peak_mem_mb`, steps after the first) and the median tokens/s of all ranks; FSDP
cells add each rank's parameter bytes after sharding (the trainer's "fsdp sharded" line).

The memory section's DDP and FSDP cells run the reference path (performance.fast_path: off): the comparison
isolates sharding. A "ddp+fast" row per model shows DDP on one GPU as users get it (fast path on). Mode
"fsdp+fast" (not in the default set) adds, on each larger GPU count, FSDP with the fast path (its fused LoRA
nodes on the weights FSDP gathers, the fused loss on the gathered head) and DDP with the fast path on as many
GPUs: the pair issue 31 compares (tokens/s per GPU of FSDP at least 0.9x DDP's).

Each finished cell is printed as a JSON line and written into report.json at once, so a run cut short keeps
what finished; --budget S starts no cell after S seconds and stops a running one at S (status "timeout").

    python bench/bench_fsdp_gpu.py --out /tmp/fsdp-bench                      # everything, on the GPUs here
    python bench/bench_fsdp_gpu.py --out /tmp/fsdp-bench --gpus 1,2 --only memory --methods qlora --budget 540
    python bench/bench_fsdp_gpu.py --out /tmp/fsdp-smoke --smoke              # CPU, tiny shapes: the script runs
    python bench/bench_fsdp_gpu.py --out /tmp/fsdp-load --gpus 2,4 --only loading --steps 3
    python bench/bench_fsdp_gpu.py --out /tmp/fsdp-eq --gpus 1,2 --only fast-equality --steps 50   # issue 31

Sections (--only): memory (DDP vs FSDP per model, method and GPU count), equality (fp32 LoRA, FSDP on N GPUs
against one GPU over the same rows: max |loss difference|), fast-equality (issue 31: LoRA and QLoRA in bf16 over
--steps, FSDP + fast path on N GPUs against one GPU's fast path, beside one GPU's fast path against its reference
path as the noise floor; not in the default set), resume (FSDP on 2 GPUs, SIGKILL after
checkpoint-2, restart: the losses against the uninterrupted run), loading (QLoRA under FSDP loaded whole or in
shards, fsdp.cpu_ram_efficient_loading: each rank's GPU peak while loading and the weights it holds right
before sharding, from the trainer's "fsdp loading" lines; not in the default set), planner (`python -m trainer
plan --gpus N` on one device for each model's and method's FSDP cell: its per-GPU prediction against the peak the memory
section measured in the same run, which runs first: --only memory,planner).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from trainer.runfolder import iter_records, last_per_step  # noqa: E402

ROWS_PER_STEP = 4  # sequences per optimizer step, whatever the GPU count (micro 1 x accumulation 4/N x N)

DENSE_8B = {  # Llama-3-8B's layer shapes
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 500000.0,
    "full_layers": 32,
}  # fmt: skip
GLM_AIR = {  # GLM-4.5-Air's (zai-org/GLM-4.5-Air config.json)
    "model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151552,
    "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "partial_rotary_factor": 0.5, "use_qk_norm": False, "attention_bias": True, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "full_layers": 46,
}  # fmt: skip
SMOKE_SHAPES = {  # CPU: the same architectures, tiny
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "n_routed_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip


def write_model(folder: Path, shapes: dict, layers: int, smoke: bool) -> Path:
    """The config, and random weights once (in a subprocess, so this process holds no GPU memory)."""
    config = {k: v for k, v in shapes.items() if k != "full_layers"}
    if smoke:
        config.update({k: v for k, v in SMOKE_SHAPES.items() if k in config})
    config["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    written = folder / "config.json"
    if (
        written.exists()
        and any(folder.glob("*.safetensors"))
        and json.loads(written.read_text()).get("num_hidden_layers") == layers
    ):
        return folder  # weights of this shape already written by an earlier run into the same --out
    written.write_text(json.dumps(config, indent=2))
    for old in folder.glob("*.safetensors*"):
        old.unlink()
    dtype = "float32" if smoke else "bfloat16"
    subprocess.run([sys.executable, __file__, "--build-weights", str(folder), dtype], check=True, cwd=REPO)
    return folder


def build_weights(folder: str, dtype: str) -> None:
    """Random weights for the config in ``folder``, built on a GPU where there is one (seconds, not the
    minute a CPU init of an 8B-shaped model takes on every rank of every cell)."""
    import torch

    harness.save_random_weights(folder, dtype, "cuda" if torch.cuda.is_available() else "cpu")


def cell_config(out: Path, model: Path, method: str, distributed: str, gpus: int, args, **extra) -> Path:
    fp32 = extra.pop("fp32", False)
    fast_path = extra.pop("fast_path", "off")
    cfg = {
        "paths": {"output_dir": str(out), "train_file": str(REPO / "data" / "tiny_corpus.jsonl")},
        "model": {
            "name_or_path": str(model),
            "tokenizer": str(REPO / "configs" / "tiny-llama"),  # ids < 1024 fit every vocabulary here
            "dtype": "fp32" if fp32 or args.smoke else "bf16",
        },
        "training": {
            "method": method,
            "distributed": distributed,
            "max_steps": args.steps,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": ROWS_PER_STEP // gpus,
            "mixed_precision": "no" if fp32 or args.smoke else "bf16",
            "save_steps": extra.pop("save_steps", 1000),
        },
        "optimization": {"optimizer": getattr(args, "optimizer", "adamw")},
        "lora": {"dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "quantization": {"compute_dtype": "fp32" if fp32 or args.smoke else "bf16"},
        "data": {"max_length": args.length, "val_fraction": 0.01},
        "eval": {"interval": 10_000, "at_end": False},
        "memory": {"gradient_checkpointing": not args.smoke and not getattr(args, "no_checkpointing", False)},
        "logging": {"progress_bar": False, "telemetry_interval": 2},
        "performance": {
            "tf32": not fp32,
            "fast_path": fast_path,
            "profile_from": getattr(args, "profile_from", 0),
            "profile_steps": 2,
            # FSDP never replays graphs (its gathers run in hooks): on would stop those cells
            "cuda_graphs": (getattr(args, "cuda_graphs", None) or "auto") if distributed == "ddp" else "auto",
        },
    }
    if distributed == "fsdp" and getattr(args, "forward_prefetch", None) is not None:
        cfg["fsdp"] = {"forward_prefetch": args.forward_prefetch}
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def command(config: Path, gpus: int, port: int) -> list[str]:
    if gpus == 1:
        return [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
            "--num_machines", "1", "--main_process_port", str(port), "-m", "trainer", "train",
            "--config", str(config)]  # fmt: skip


def environment(args) -> dict:
    env = harness.child_env(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if args.smoke:
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    return env


class Budget:
    """Seconds left of --budget (None: no limit)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.started = seconds, time.monotonic()

    def left(self) -> float | None:
        return None if not self.seconds else self.seconds - (time.monotonic() - self.started)

    def spent(self, margin: float = 20.0) -> bool:
        left = self.left()
        return left is not None and left < margin


def train(config: Path, gpus: int, args) -> subprocess.CompletedProcess:
    """One cell; past the budget its launcher and ranks are killed and the return code is "timeout"."""
    args.port += 1
    proc = subprocess.Popen(command(config, gpus, args.port), cwd=REPO, env=environment(args), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=args.budget.left())
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        code = harness.TIMED_OUT
    return subprocess.CompletedProcess(proc.args, code, stdout, stderr)


def status(result: subprocess.CompletedProcess) -> str:
    if result.returncode == harness.TIMED_OUT:
        return "timeout (budget)"
    return "oom" if oom(result) else f"failed ({result.returncode})"


def records(run: Path) -> list[dict]:
    return last_per_step(list(iter_records(run / "logs" / "training_log.jsonl")))


def figures(run: Path, gpus: int) -> dict:
    recs = records(run)
    later = recs[1:] or recs  # the first step compiles, allocates and warms up
    peak = max((r.get("peak_mem_mb") or 0) for r in later) if later else None
    total = statistics.median(r["tokens_per_sec"] for r in later) if later else None
    return {
        "peak_gib": round(peak / 1024, 2) if peak else None,
        "tokens_per_s_per_gpu": round(total / gpus) if total else None,
        "losses": [r["loss"] for r in recs],
        "fast_path": fast_path_ran(run),
    }


def fast_path_ran(run: Path) -> str:
    """What the run's events say of the fast path: off (and why), or the fused LoRA nodes it ran, and whether its
    layers replayed from CUDA graphs (the last ``cuda_graphs`` event, else the model report's decision)."""
    events = list(iter_records(run / "logs" / "events.jsonl"))
    report = next((e for e in events if e.get("event") == "model_report"), {})
    fast = report.get("fast_path") or {}
    if not fast.get("enabled"):
        return f"off: {fast.get('reason', '?')}"
    graphs = [e for e in events if e.get("event") == "cuda_graphs"]
    if graphs:
        replay = f"graphs {graphs[-1].get('state')}: {graphs[-1].get('detail')}"
    else:
        replay = f"graphs {fast.get('cuda_graphs', '?')}"
    return (
        f"on: {fast.get('lora_modules_fused', 0)} LoRA nodes, fused loss {fast.get('fused_loss')}, {replay}"
    )


def bytes_per_param(method: str, mode: str) -> float:
    """What one left-out parameter adds: NF4 + double-quant constants; bf16 frozen; full fine-tuning adds its
    gradient and AdamW's two moments, in bf16 under DDP and in fp32 under FSDP (accelerate keeps FSDP's
    trainable parameters as fp32 masters under mixed precision)."""
    if method == "full":
        return 16.0 if mode.startswith("fsdp") else 8.0
    return {"qlora": 0.53, "lora": 2.0}[method]


def layer_params(folder: Path) -> int:
    """Parameters of one repeated (last) decoder layer, counted on the meta device from the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    counts = []
    for layers in (1, 2):
        config.num_hidden_layers = layers
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()))
    return counts[1] - counts[0]


def full_model_gib(row: dict, per_layer: int, full_layers: int) -> float | None:
    """The measured peak plus the weights of the layers left out, divided among the GPUs under FSDP."""
    if not row.get("peak_gib"):
        return None
    missing = (full_layers - row["layers"]) * per_layer * bytes_per_param(row["method"], row["mode"]) / 2**30
    return round(row["peak_gib"] + missing / (row["gpus"] if row["mode"].startswith("fsdp") else 1), 1)


def oom(result: subprocess.CompletedProcess) -> bool:
    text = result.stdout[-5000:] + result.stderr[-5000:]
    return "out of memory" in text.lower()


# ---------------------------------------------------------------- sections


def sharded_lines(stdout: str) -> dict[int, int]:
    """rank -> parameter bytes it holds after sharding, from the trainer's "fsdp sharded" lines."""
    import re

    return {int(r): int(b) for r, b in re.findall(r"fsdp sharded: rank (\d+) holds (\d+) bytes", stdout)}


def memory_cells(args, models: dict) -> list[tuple[str, str, str, int]]:
    """(model, method, mode, gpus) in the order a short call needs them: each model's sharding ladder first
    (DDP on one GPU, then FSDP on each larger count: the 1/N figure), then DDP on the larger counts (the
    throughput it is compared with), then DDP with the fast path (the context: what FSDP gives up)."""
    several = [g for g in args.gpus if g > 1]
    modes = set(args.modes)
    ladder, throughput, context, fast = [], [], [], []
    for name in models:
        for method in args.methods:
            if 1 in args.gpus:
                ladder.append((name, method, "ddp", 1))
            ladder += [(name, method, "fsdp", g) for g in several]
            throughput += [(name, method, "ddp", g) for g in several]
            if 1 in args.gpus and not args.smoke:
                context.append((name, method, "ddp+fast", 1))
            if {"fsdp+fast", "ddp+fast"} & modes and not args.smoke:
                for g in several:
                    fast += [(name, method, "fsdp+fast", g), (name, method, "ddp+fast", g)]
    return [cell for cell in ladder + throughput + context + fast if cell[2] in modes]


def memory(args, models: dict, out: Path, report: Report) -> None:
    per_layer = {name: layer_params(folder) for name, (folder, _, _) in models.items()}
    for name, method, mode, gpus in memory_cells(args, models):
        folder, layers, full_layers = models[name]
        row = {"model": name, "layers": layers, "method": method, "mode": mode, "gpus": gpus}
        if args.budget.spent():
            report.add("memory", {**row, "status": "skipped (budget)"})
            continue
        distributed = "fsdp" if mode.startswith("fsdp") else "ddp"
        run = out / "memory" / f"{name}-{method}-{mode}-{gpus}"
        fast_path = "auto" if mode.endswith("+fast") else "off"
        started = time.monotonic()
        result = train(
            cell_config(run, folder, method, distributed, gpus, args, fast_path=fast_path), gpus, args
        )
        row["seconds"] = round(time.monotonic() - started)
        if result.returncode != 0:
            row["status"] = status(result)
            (run.parent / f"{run.name}.log").write_text(result.stdout + result.stderr)
        else:
            row.update(figures(run, gpus), status="ok")
            row.pop("losses")
            held = sharded_lines(result.stdout)
            if held:
                row["params_mib_max_rank"] = round(max(held.values()) / 2**20, 1)
            row[f"full_{full_layers}_layers_gib"] = full_model_gib(row, per_layer[name], full_layers)
        report.add("memory", row)


def equality(args, models: dict, out: Path, report: Report) -> None:
    """fp32 LoRA on the dense shape: FSDP on N GPUs against one GPU over the same rows."""
    folder = models["dense"][0]
    if args.budget.spent():
        report.add("equality", {"status": "skipped (budget)"})
        return
    reference = out / "equality" / "dense-1"
    result = train(cell_config(reference, folder, "lora", "ddp", 1, args, fp32=True), 1, args)
    if result.returncode != 0:
        report.add("equality", {"status": f"1-GPU reference {status(result)}: {result.stderr[-300:]}"})
        return
    one = figures(reference, 1)["losses"]
    for gpus in [g for g in args.gpus if g > 1]:
        if args.budget.spent():
            report.add("equality", {"gpus": gpus, "status": "skipped (budget)"})
            continue
        run = out / "equality" / f"dense-fsdp-{gpus}"
        result = train(cell_config(run, folder, "lora", "fsdp", gpus, args, fp32=True), gpus, args)
        if result.returncode != 0:
            report.add("equality", {"gpus": gpus, "status": f"{status(result)}: {result.stderr[-300:]}"})
            continue
        losses = figures(run, gpus)["losses"]
        report.add(
            "equality",
            {
                "gpus": gpus,
                "steps": len(losses),
                "max_abs_loss_diff": max_abs_diff(losses, one),
                "status": "ok",
            },
        )


def max_abs_diff(a: list[float], b: list[float]) -> float | None:
    """The largest per-step loss difference of two runs over the same rows (None when their lengths differ)."""
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else None


def fast_equality(args, models: dict, out: Path, report: Report) -> None:
    """Issue 31's check of the fast path under FSDP, in bf16 over --steps: FSDP + fast on N GPUs against one GPU's
    fast path over the same rows; beside it one GPU's fast path against its reference path (fast_path off), the
    bf16 noise the first difference is judged by."""
    folder = models["dense"][0]
    for method in args.methods:
        one = {}
        for fast_path in ("on", "off"):
            if args.budget.spent():
                report.add("fast_equality", {"method": method, "gpus": 1, "status": "skipped (budget)"})
                break
            run = out / "fast-equality" / f"dense-{method}-1-fast-{fast_path}"
            result = train(cell_config(run, folder, method, "ddp", 1, args, fast_path=fast_path), 1, args)
            if result.returncode != 0:
                row = {"method": method, "gpus": 1, "status": f"fast path {fast_path}: {status(result)}"}
                report.add("fast_equality", {**row, "detail": result.stderr[-300:]})
                break
            one[fast_path] = figures(run, 1)["losses"]
        if len(one) < 2:
            continue
        noise = max_abs_diff(one["on"], one["off"])
        for gpus in [g for g in args.gpus if g > 1]:
            row = {"method": method, "gpus": gpus}
            if args.budget.spent():
                report.add("fast_equality", {**row, "status": "skipped (budget)"})
                continue
            run = out / "fast-equality" / f"dense-{method}-fsdp-{gpus}"
            result = train(cell_config(run, folder, method, "fsdp", gpus, args, fast_path="on"), gpus, args)
            if result.returncode != 0:
                report.add("fast_equality", {**row, "status": status(result), "detail": result.stderr[-300:]})
                continue
            ran = figures(run, gpus)
            row.update(steps=len(ran["losses"]), max_abs_loss_diff=max_abs_diff(ran["losses"], one["on"]))
            report.add(
                "fast_equality", {**row, "noise_floor": noise, "fast_path": ran["fast_path"], "status": "ok"}
            )


def loading_lines(stdout: str) -> dict[int, tuple[int, float | None]]:
    """rank -> (bytes held before sharding, GPU peak MiB while loading), from the trainer's lines."""
    import re

    found = {}
    pattern = r"fsdp loading: rank (\d+) holds (\d+) bytes[^;\n]*(?:; GPU peak while loading (\d+) MiB)?"
    for rank, held, peak in re.findall(pattern, stdout):
        found[int(rank)] = (int(held), float(peak) if peak else None)
    return found


def loading(args, models: dict, out: Path, report: Report) -> None:
    """QLoRA under FSDP on each GPU count > 1, loaded whole and in shards: the load-time figures per rank
    (the largest over ranks), and the training peak after, for both models."""
    for name, (folder, layers, _) in models.items():
        for gpus in [g for g in args.gpus if g > 1]:
            for in_shards in (False, True):
                row = {
                    "model": name,
                    "layers": layers,
                    "gpus": gpus,
                    "loading": "shards" if in_shards else "whole",
                }
                if args.budget.spent():
                    report.add("loading", {**row, "status": "skipped (budget)"})
                    continue
                run = out / "loading" / f"{name}-qlora-{gpus}-{row['loading']}"
                config = cell_config(run, folder, "qlora", "fsdp", gpus, args)
                cfg = yaml.safe_load(config.read_text())
                cfg["fsdp"] = {"cpu_ram_efficient_loading": in_shards}
                config.write_text(yaml.safe_dump(cfg))
                result = train(config, gpus, args)
                lines = loading_lines(result.stdout)
                if lines:
                    row["held_mib_max_rank"] = round(max(h for h, _ in lines.values()) / 2**20, 1)
                    peaks = [p for _, p in lines.values() if p is not None]
                    row["load_peak_gib_max_rank"] = round(max(peaks) / 1024, 2) if peaks else None
                if result.returncode != 0:
                    row["status"] = status(result)
                    (run.parent / f"{run.name}.log").write_text(result.stdout + result.stderr)
                else:
                    row["train_peak_gib"] = figures(run, gpus)["peak_gib"]
                    row["status"] = "ok"
                report.add("loading", row)


def plan_command(config: Path, gpus: int) -> list[str]:
    """The planner's dry run on one device, predicting each of ``gpus`` GPUs' peak under FSDP."""
    return [sys.executable, "-m", "trainer", "plan", "--config", str(config), "--gpus", str(gpus),
            "--plan-steps", "2", "--margin", "0"]  # fmt: skip


def predicted_gib(plan_json: Path, micro: int, length: int) -> float | None:
    """The planner's per-GPU prediction for the shape the FSDP cells train (plan.json's candidate)."""
    for candidate in json.loads(plan_json.read_text())["candidates"]:
        if candidate["micro"] == micro and candidate["max_length"] == length and candidate.get("per_gpu_mb"):
            return round(candidate["per_gpu_mb"] / 1024, 2)
    return None


def planner(args, models: dict, out: Path, report: Report) -> None:
    """`plan --gpus N` on one device for each model's and method's FSDP cell, against the peak that cell
    measured (the memory section's row in this report, when it ran): issue 16's check of the planner."""
    measured = {
        (r["model"], r["method"], r["gpus"]): r.get("peak_gib")
        for r in report.data.get("memory", [])
        if r.get("mode") == "fsdp"
    }
    for name, (folder, layers, _) in models.items():
        for method in args.methods:
            for gpus in [g for g in args.gpus if g > 1]:
                row = {"model": name, "layers": layers, "method": method, "gpus": gpus}
                if args.budget.spent():
                    report.add("planner", {**row, "status": "skipped (budget)"})
                    continue
                report.add("planner", dry_run(args, folder, method, gpus, out / "planner" / f"{name}-{method}-{gpus}",
                                              {**row, "measured_gib": measured.get((name, method, gpus))}))  # fmt: skip


def earlier_memory_rows(report_json: Path) -> list[dict]:
    """--measured: the memory rows of an earlier call's report.json, which the planner section reads as the
    measured peaks (a call too short for both sections measures first, then predicts)."""
    return json.loads(report_json.read_text()).get("memory", [])


def dry_run(args, folder: Path, method: str, gpus: int, run: Path, row: dict) -> dict:
    """One planner row: the dry run's prediction for the FSDP cell's shape beside the measured peak."""
    config = cell_config(run, folder, method, "fsdp", gpus, args)
    result = harness.run_child(
        plan_command(config, gpus), args.budget.left(), cwd=REPO, env=environment(args)
    )
    if result.returncode == harness.TIMED_OUT:
        return {**row, "status": "timeout (budget)"}
    if result.returncode != 0 or not (run / "plan.json").exists():
        return {**row, "status": f"failed ({result.returncode}): {(result.stderr or result.stdout)[-300:]}"}
    row["predicted_gib"] = predicted_gib(run / "plan.json", 1, args.length)
    if row["predicted_gib"] and row["measured_gib"]:
        row["predicted_over_measured"] = round(row["predicted_gib"] / row["measured_gib"], 2)
    return {**row, "status": "ok"}


def kill_tree(pid: int) -> None:
    import psutil

    try:
        launcher = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def resume(args, models: dict, out: Path, report: Report) -> None:
    """FSDP on 2 GPUs: SIGKILL once checkpoint-2 exists, restart, compare with an uninterrupted run."""
    if args.budget.spent(margin=60):
        report.add("resume", {"gpus": 2, "status": "skipped (budget)"})
        return
    folder = models["dense"][0]
    plain = out / "resume" / "plain"
    result = train(cell_config(plain, folder, "lora", "fsdp", 2, args, fp32=True, save_steps=2), 2, args)
    if result.returncode != 0:
        report.add(
            "resume", {"gpus": 2, "status": f"uninterrupted run {status(result)}: {result.stderr[-300:]}"}
        )
        return
    killed = out / "resume" / "killed"
    config = cell_config(killed, folder, "lora", "fsdp", 2, args, fp32=True, save_steps=2)
    args.port += 1
    proc = subprocess.Popen(command(config, 2, args.port), cwd=REPO, env=environment(args),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    while not (killed / "checkpoint-2" / "trainer_state.json").exists() and proc.poll() is None:
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait()
    finished_before_kill = (killed / f"final-checkpoint-{args.steps}").exists()
    result = train(config, 2, args)
    a, b = figures(plain, 2)["losses"], figures(killed, 2)["losses"]
    row = {
        "gpus": 2,
        "killed_after": "checkpoint-2",
        "finished_before_kill": finished_before_kill,
        "resumed": "resuming from" in result.stdout,
        "steps": len(b),
        "max_abs_loss_diff": max_abs_diff(a, b),
        "status": "ok" if result.returncode == 0 else status(result),
    }
    report.add("resume", row)


class Report:
    """report.json, rewritten (atomically) after every cell, so a run cut short keeps what finished."""

    def __init__(self, path: Path, args):
        self.path = path
        self.data: dict = {"args": {k: v for k, v in vars(args).items() if k != "budget"}}
        self.write()

    def add(self, section: str, row: dict) -> None:
        self.data.setdefault(section, []).append(row)
        print(json.dumps(row), flush=True)
        self.write()

    def write(self) -> None:
        harness.write_json(self.path, self.data)


def table(rows: list[dict], columns: list[str]) -> str:
    return harness.markdown_table(columns, [[row.get(c, "") for c in columns] for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/fsdp-bench")
    parser.add_argument(
        "--gpus", default=None, help="GPU counts, comma-separated (default: 1,2,4 up to those here)"
    )
    parser.add_argument("--only", default="memory,equality,resume")
    parser.add_argument("--models", default="dense,glm_air", help="for every section that takes both")
    parser.add_argument("--methods", default="qlora,lora", help="for the memory section")
    parser.add_argument(
        "--modes", default="ddp,fsdp,ddp+fast", help="memory section: which of ddp, fsdp, ddp+fast to run"
    )
    parser.add_argument(
        "--optimizer", default="adamw", help="optimization.optimizer of every cell (bitsandbytes' under FSDP)"
    )
    parser.add_argument("--dense-layers", type=int, default=8, help="decoder layers of the Llama-3-8B shape")
    parser.add_argument(
        "--moe-layers",
        type=int,
        default=3,
        help="decoder layers of the GLM-4.5-Air shape: its first is dense, so 3 gives two MoE layers and "
        "the per-layer figure is the last (MoE) layer's",
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="optimizer steps per cell; the first is not measured"
    )
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds: no cell starts after, one running stops"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU processes (gloo), tiny shapes: the script runs"
    )
    parser.add_argument(
        "--measured", default=None, help="an earlier report.json whose memory rows the planner section reads"
    )
    parser.add_argument(
        "--profile-from",
        type=int,
        default=0,
        help="each cell profiles two steps from this one (performance.profile_from): <cell>/profile/ per rank",
    )
    parser.add_argument(
        "--forward-prefetch",
        type=int,
        default=None,
        help="FSDP cells: fsdp.forward_prefetch (units gathered ahead in forward; 0 is torch's implicit "
        "prefetch); default: the config's",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="performance.cuda_graphs of the DDP cells (auto: DDP + fast LoRA/QLoRA replay their layers)",
    )
    parser.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="cells without gradient checkpointing (DDP + fast then replays its whole layer stack)",
    )
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--build-weights", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_weights:
        build_weights(*args.build_weights)
        return 0
    if args.smoke:
        args.steps, args.length, args.methods = min(args.steps, 4), 64, "lora"
        args.dense_layers, args.moe_layers = 2, 2
    if args.gpus:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    else:
        import torch

        here = 2 if args.smoke else torch.cuda.device_count()
        args.gpus = [g for g in (1, 2, 4) if g <= here]
    args.methods = args.methods.split(",")
    args.modes = args.modes.split(",")
    unknown = set(args.modes) - {"ddp", "fsdp", "ddp+fast", "fsdp+fast"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; expected ddp, fsdp, ddp+fast or fsdp+fast")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "report.json", args)
    if args.measured:
        report.data["memory"] = earlier_memory_rows(Path(args.measured))
    args.budget = Budget(args.budget)
    models_dir = out / "models"
    shapes = {
        "dense": (DENSE_8B, "dense8b", args.dense_layers),
        "glm_air": (GLM_AIR, "glm_air", args.moe_layers),
    }
    models = {
        name: (write_model(models_dir / folder, shape, layers, args.smoke), layers, shape["full_layers"])
        for name, (shape, folder, layers) in shapes.items()
        if name in args.models.split(",")
        or (name == "dense" and {"equality", "fast-equality", "resume"} & set(args.only.split(",")))
    }
    sections = args.only.split(",")
    if "memory" in sections:
        memory(args, {k: v for k, v in models.items() if k in args.models.split(",")}, out, report)
        rows = report.data.get("memory", [])
        print("\nper-GPU peak memory and throughput (rank 0's peak allocated; tokens/s per GPU):")
        cols = ["model", "layers", "method", "mode", "gpus", "peak_gib", "params_mib_max_rank"]
        cols += ["tokens_per_s_per_gpu"] + sorted({k for r in rows for k in r if k.startswith("full_")})
        print(table(rows, cols + ["fast_path", "seconds", "status"]))
        print(
            "full_*: the measured peak plus the left-out layers' weights (divided among the GPUs under FSDP); "
            "ddp and fsdp rows run the reference path, ddp+fast and fsdp+fast the CUDA fast path"
        )
    if "equality" in sections:
        equality(args, models, out, report)
        print("\nloss equality, fp32 LoRA (dense shape), FSDP on N GPUs vs one GPU over the same rows:")
        print(table(report.data.get("equality", []), ["gpus", "steps", "max_abs_loss_diff", "status"]))
    if "fast-equality" in sections:
        fast_equality(args, models, out, report)
        print(
            "\nFSDP + fast path on N GPUs vs one GPU's fast path over the same rows (bf16; noise_floor: one GPU's "
            "fast path vs its reference path):"
        )
        cols = ["method", "gpus", "steps", "max_abs_loss_diff", "noise_floor", "fast_path", "status"]
        print(table(report.data.get("fast_equality", []), cols))
    if "loading" in sections:
        loading(args, {k: v for k, v in models.items() if k in args.models.split(",")}, out, report)
        print(
            "\nQLoRA under FSDP loaded whole or in shards (largest rank; train peak: rank 0, steps after the first):"
        )
        cols = ["model", "layers", "gpus", "loading", "held_mib_max_rank", "load_peak_gib_max_rank"]
        print(table(report.data.get("loading", []), cols + ["train_peak_gib", "status"]))
    if "planner" in sections:
        planner(args, {k: v for k, v in models.items() if k in args.models.split(",")}, out, report)
        print(
            "\nthe planner's per-GPU prediction (one-device dry run) against the FSDP cell's measured peak:"
        )
        cols = [
            "model",
            "layers",
            "method",
            "gpus",
            "predicted_gib",
            "measured_gib",
            "predicted_over_measured",
            "status",
        ]
        print(table(report.data.get("planner", []), cols))
    if "resume" in sections and 2 in args.gpus:
        resume(args, models, out, report)
        print("\nSIGKILL after checkpoint-2 on 2 GPUs (FSDP), restart, against the uninterrupted run:")
        cols = [
            "gpus",
            "killed_after",
            "finished_before_kill",
            "resumed",
            "steps",
            "max_abs_loss_diff",
            "status",
        ]
        print(table(report.data.get("resume", []), cols))
    print(f"\nreport: {out / 'report.json'}")
    failed = [
        r
        for s in ("memory", "equality", "fast_equality", "resume", "loading", "planner")
        for r in report.data.get(s, [])
        if r.get("status") not in ("ok", "oom", "skipped (budget)")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
