"""GPU benchmark of the trainer core against what a user would pick instead, in one call on one card.

Rows per model shape and setting (LoRA + activation checkpointing, QLoRA NF4 + checkpointing, LoRA without):
this kit (``python -m trainer train``: the CUDA fast path, and with ``ref`` the reference path), transformers'
Trainer + PEFT (``hf``), the same with Liger's kernels (``liger``), and Unsloth (``unsloth``, through
``../shared/anchors/unsloth_bench.py`` given as ``--anchors``: its own Llama-1B, or our Qwen3 folder). Random-init weights saved once in bf16,
micro-batch 4 x 2048 tokens, LoRA r16 alpha 32 on all seven linear layers, bf16, median tokens/s after 5
warm-up steps. The kit and Trainer rows train the shipped corpus packed into 2048-token rows; Unsloth's
script feeds random tokens of the same shape (throughput does not depend on token values).

    python bench/bench_core_gpu.py --anchors .anchors --steps 15 --out /tmp/bench          # Llama rows
    python bench/bench_core_gpu.py --only qwen3 --impl ours,ref,liger --out /tmp/bench
    python bench/bench_core_gpu.py --loss-steps 200 --out /tmp/bench   # fast vs reference, per step
    python bench/bench_core_gpu.py --resume-check --out /tmp/bench     # SIGKILL mid-run, resume, compare
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
GLM_SMALL = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": False,
    "attention_bias": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def model_dir(root: Path, name: str, config: dict, weights: bool = False) -> Path:
    """A local model folder: config.json plus the shipped offline tokenizer (its ids are valid in any vocab);
    with ``weights``, random-init weights saved once in bf16 so every run loads them in seconds."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "configs" / "tiny-moe" / file, folder / file)
    if weights and not (folder / "model.safetensors").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
    return folder


def long_documents(root: Path) -> Path:
    """The shipped corpus joined into one long document, so every 2048-token row is a plain causal window
    (as in the anchors' fixed-length rows) rather than several packed documents, whose block-diagonal
    mask keeps SDPA off its flash kernels; packed short documents are bench_packing_gpu.py's subject."""
    path = root / "long_document.jsonl"
    if not path.exists():
        texts = [json.loads(line)["text"] for line in (REPO / "data" / "tiny_corpus.jsonl").open()]
        path.write_text(json.dumps({"text": "\n\n".join(texts)}) + "\n")
    return path


def trainer_config(
    out: Path, model: Path, method: str, steps: int, checkpointing: bool, targets: list[str], **extra
) -> Path:
    import yaml

    cfg = {
        "paths": {"output_dir": str(out), "train_file": str(long_documents(out.parent))},
        "model": {"name_or_path": str(model), "random_init": not (model / "model.safetensors").exists()},
        "training": {
            "method": method,
            "max_steps": steps,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "mixed_precision": "bf16",
            "save_steps": 10_000,
        },
        "optimization": {"learning_rate": 2e-4, "lr_scheduler": "constant"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": targets},
        "quantization": {"compute_dtype": "bf16"},
        "data": {"max_length": 2048, "val_fraction": 0.0, "long_documents": "split"},
        "eval": {"interval": 10_000, "at_end": False},
        "memory": {"gradient_checkpointing": checkpointing},
        "logging": {"progress_bar": False, "telemetry_interval": 2, "expert_interval": 5},
        "performance": {"fast_path": extra.pop("fast_path", "auto")},
    }
    for key, value in extra.items():  # section.key overrides
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def summarise_run(run: Path, warmup: int) -> dict:
    from trainer.runfolder import iter_records

    records = list(iter_records(run / "logs" / "training_log.jsonl"))
    steady = records[warmup:] or records
    events = list(iter_records(run / "logs" / "events.jsonl"))
    report = next((e for e in events if e["event"] == "model_report"), {})
    experts = list(iter_records(run / "logs" / "expert_usage_log.jsonl"))
    return {
        "steps": len(records),
        "tokens_per_sec": round(statistics.median(r["tokens_per_sec"] for r in steady), 1),
        "peak_gib": round(max(r["peak_mem_mb"] for r in records) / 1024, 2),
        "final_loss": records[-1]["loss"],
        "quantized_params": report.get("quantized_params"),
        "total_params": report.get("total_params"),
        "unquantized_expert_bytes": report.get("unquantized_expert_bytes"),
        "expert_records": len(experts),
        "fast_path": (report.get("fast_path") or {}).get("enabled"),
        "losses": [r["loss"] for r in records],
    }


def run_ours(
    root: Path, name: str, model: Path, method: str, steps: int, checkpointing: bool, targets, **extra
) -> dict:
    out = root / name.replace(" ", "_").replace("+", "-")
    shutil.rmtree(out, ignore_errors=True)
    config = trainer_config(out, model, method, steps, checkpointing, targets, **extra)
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    row = {"name": name, "impl": "ours", "wall_s": round(time.time() - started, 1)}
    if result.returncode != 0:
        return {**row, "error": (result.stderr or result.stdout)[-1500:]}
    return {**row, **summarise_run(out, warmup=5)}


def run_hf(model: Path, steps: int, quantize: bool, checkpointing: bool, liger: bool) -> dict:
    """transformers' Trainer + PEFT (optionally with Liger's kernels) on the same model, rows and settings."""
    args = [sys.executable, str(REPO / "bench" / "hf_trainer_baseline.py"), "--model", str(model)]
    args += ["--train-file", str(long_documents(model.parent.parent))]
    args += ["--steps", str(steps)] + ["--qlora"] * quantize + ["--checkpointing"] * checkpointing
    args += ["--liger"] * liger
    try:
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if result.returncode != 0:
        return {"error": (result.stderr or result.stdout)[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_unsloth(anchors: Path, steps: int, model: Path | None = None) -> dict[str, dict]:
    """Unsloth's three settings through the shared anchor script (each in its own process there).

    ``model``: a model folder other than the anchor's own Llama-1B (the Qwen3 row), as its MODEL_DIR."""
    env = {**os.environ, "STEPS": str(steps)}
    if model is not None:
        env["MODEL_DIR"] = str(model)
    try:
        result = subprocess.run(
            [sys.executable, "unsloth_bench.py"],
            cwd=anchors,
            capture_output=True,
            text=True,
            env=env,
            timeout=420,
        )
    except subprocess.TimeoutExpired as exc:
        result = subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", exc.stderr or "")
    rows = {}
    for line in str(result.stdout).splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT ") :])
            setting = {"unsloth-lora-bf16": "lora+gc", "unsloth-qlora-nf4": "qlora+gc"}.get(
                row["name"], "lora"
            )
            rows[setting] = {
                "tokens_per_sec": row.get("tokens_per_s"),
                "peak_gib": row.get("peak_gib"),
                **row,
            }
    return rows


SETTINGS = {"lora+gc": ("lora", True), "qlora+gc": ("qlora", True), "lora": ("lora", False)}
SHAPES = {"llama": ("llama-1b", LLAMA_1B), "qwen3": ("qwen3-0.6b", QWEN3_06B)}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(root: Path, shape: str, impls: set[str], steps: int, anchors: Path | None) -> list[dict]:
    name, config = SHAPES[shape]
    model = model_dir(root / "models", name, config, weights=True)
    rows = []
    for setting, (method, gc) in SETTINGS.items():
        cell = {"shape": shape, "setting": setting}
        if "ours" in impls:
            cell["ours"] = run_ours(root, f"{shape} {setting}", model, method, steps, gc, ALL_LINEAR)
        if "ref" in impls:
            cell["ref"] = run_ours(
                root, f"{shape} {setting} ref", model, method, steps, gc, ALL_LINEAR, fast_path="off"
            )
        for impl, liger in (("hf", False), ("liger", True)):
            if impl in impls:
                cell[impl] = run_hf(model, steps, method == "qlora", gc, liger)
        rows.append(cell)
    if "unsloth" in impls and anchors is not None:
        unsloth = run_unsloth(anchors, steps, None if shape == "llama" else model)
        for cell in rows:
            cell["unsloth"] = unsloth.get(cell["setting"], {"error": "no result"})
    return rows


def print_table(rows: list[dict]) -> None:
    impls = ["ours", "ref", "hf", "liger", "unsloth"]
    print(f"{'shape':<7}{'setting':<10}" + "".join(f"{i + ' tok/s | GiB':>24}" for i in impls), end="")
    print(f"{'ours/unsloth':>14}{'ours/liger':>12}{'mem/unsloth':>13}")
    for cell in rows:
        line = f"{cell['shape']:<7}{cell['setting']:<10}"
        for impl in impls:
            r = cell.get(impl)
            if not r:
                line += f"{'':>24}"
            elif "error" in r:
                line += f"{'ERROR':>24}"
            else:
                line += f"{r['tokens_per_sec']:>14,.0f} | {r['peak_gib']:>5.2f}".rjust(24)
        ours, liger, unsloth = (cell.get(k) or {} for k in ("ours", "liger", "unsloth"))

        def ratio(a, b, key):
            return f"{a[key] / b[key]:.2f}x" if a.get(key) and b.get(key) else "-"

        line += f"{ratio(ours, unsloth, 'tokens_per_sec'):>14}{ratio(ours, liger, 'tokens_per_sec'):>12}"
        line += f"{ratio(ours, unsloth, 'peak_gib'):>13}"
        print(line)
    for cell in rows:
        for impl in ("ours", "ref", "hf", "liger", "unsloth"):
            if (cell.get(impl) or {}).get("error"):
                print(f"ERROR {cell['shape']} {cell['setting']} {impl}: {cell[impl]['error'][-600:]}")


def loss_check(root: Path, steps: int) -> dict:
    """Per-step loss of the fast path against the reference path over ``steps`` steps (same data, seed)."""
    model = model_dir(root / "models", *SHAPES["llama"], weights=True)
    fast = run_ours(root, "loss fast", model, "lora", steps, True, ALL_LINEAR, **{"eval.interval": 10_000})
    ref = run_ours(root, "loss ref", model, "lora", steps, True, ALL_LINEAR, fast_path="off")
    if "error" in fast or "error" in ref:
        return {"error": fast.get("error") or ref.get("error")}
    diffs = [abs(a - b) for a, b in zip(fast["losses"], ref["losses"])]
    return {
        "steps": len(diffs),
        "max_abs_diff": round(max(diffs), 5),
        "mean_abs_diff": round(sum(diffs) / len(diffs), 5),
        "first": (fast["losses"][0], ref["losses"][0]),
        "last": (fast["losses"][-1], ref["losses"][-1]),
        "fast_path": fast["fast_path"],
        "fast_losses": fast["losses"],
        "ref_losses": ref["losses"],
    }


def resume_check(root: Path, steps: int = 20, kill_after: int = 10) -> dict:
    """The fast path resumes exactly: SIGKILL once checkpoint-``kill_after`` exists, re-run, compare losses."""
    model = model_dir(root / "models", *SHAPES["llama"], weights=True)
    straight = run_ours(root, "resume straight", model, "lora", steps, True, ALL_LINEAR)
    out = root / "resume_killed"
    shutil.rmtree(out, ignore_errors=True)
    config = trainer_config(
        out, model, "lora", steps, True, ALL_LINEAR, **{"training.save_steps": kill_after}
    )
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not (out / f"checkpoint-{kill_after}").exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if resumed.returncode != 0 or "error" in straight:
        return {"error": (resumed.stderr or "")[-1500:] or straight.get("error")}
    from trainer.runfolder import iter_records, last_per_step

    after = {r["step"]: r for r in last_per_step(list(iter_records(out / "logs" / "training_log.jsonl")))}
    diffs = [
        abs(after[i + 1]["loss"] - straight["losses"][i]) for i in range(kill_after, steps) if i + 1 in after
    ]
    return {"compared_steps": len(diffs), "max_abs_diff": max(diffs) if diffs else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default="/tmp/bench-core")
    parser.add_argument("--only", default="llama", help="comma-separated shapes: llama, qwen3, glm")
    parser.add_argument("--impl", default="ours,ref,hf,liger,unsloth")
    parser.add_argument("--anchors", type=Path, help="folder with unsloth_bench.py (../shared/anchors)")
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="compare per-step losses, fast vs reference"
    )
    parser.add_argument("--resume-check", action="store_true")
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    impls = set(args.impl.split(","))
    results: dict = {"rows": []}
    for shape in args.only.split(","):
        if shape == "glm":
            glm = model_dir(root / "models", "glm4-moe-small", GLM_SMALL)
            attn = ALL_LINEAR[:4]
            cell = {"shape": "glm", "setting": "qlora+gc"}
            cell["ours"] = run_ours(root, "glm qlora+gc", glm, "qlora", args.steps, True, attn)
            cell["ref"] = run_ours(
                root, "glm qlora+gc ref", glm, "qlora", args.steps, True, attn, fast_path="off"
            )
            results["rows"].append(cell)
        elif shape in SHAPES:
            results["rows"] += measure(root, shape, impls, args.steps, args.anchors)
    if results["rows"]:
        print_table(results["rows"])
    if args.loss_steps:
        results["loss_check"] = loss_check(root, args.loss_steps)
        print(
            "LOSS", json.dumps({k: v for k, v in results["loss_check"].items() if not k.endswith("losses")})
        )
    if args.resume_check:
        results["resume_check"] = resume_check(root)
        print("RESUME", json.dumps(results["resume_check"]))
    (root / "bench_core_gpu.json").write_text(json.dumps(results, indent=2))
    if os.environ.get("OUT"):
        shutil.copy(root / "bench_core_gpu.json", Path(os.environ["OUT"]) / "bench_core_gpu.json")


if __name__ == "__main__":
    main()
