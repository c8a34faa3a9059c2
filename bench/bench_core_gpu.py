"""GPU benchmark of the trainer core: QLoRA / LoRA on a Llama-3.2-1B-shaped model, a scaled-down GLM-4.5
(glm4_moe) QLoRA with 4-bit experts, and transformers' Trainer + PEFT as the baseline, in one run.

Random-init weights (no Hub here), the shipped corpus packed into 2048-token rows, bf16, micro-batch 4.
Prints one table (tokens/s, peak GiB, ratio to the baseline) and writes JSON.

    python bench/bench_core_gpu.py --steps 30 --out /tmp/bench            # all rows
    python bench/bench_core_gpu.py --only glm --steps 20 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def model_dir(root: Path, name: str, config: dict) -> Path:
    """A local model folder: config.json plus the shipped offline tokenizer (its ids are valid in any vocab)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "configs" / "tiny-moe" / file, folder / file)
    return folder


def trainer_config(
    out: Path, model: Path, method: str, steps: int, checkpointing: bool, targets: list[str]
) -> Path:
    import yaml

    cfg = {
        "paths": {"output_dir": str(out), "train_file": str(REPO / "data" / "tiny_corpus.jsonl")},
        "model": {"name_or_path": str(model), "random_init": True},
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
        "data": {"max_length": 2048, "val_fraction": 0.01},
        "eval": {"interval": 10_000, "at_end": False},
        "memory": {"gradient_checkpointing": checkpointing},
        "logging": {"progress_bar": False, "telemetry_interval": 2, "expert_interval": 5},
    }
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
    }


def run_ours(
    root: Path, name: str, model: Path, method: str, steps: int, checkpointing: bool, targets
) -> dict:
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    config = trainer_config(out, model, method, steps, checkpointing, targets)
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    row = {"name": name, "impl": "ours", "wall_s": round(time.time() - started, 1)}
    if result.returncode != 0:
        return {**row, "error": (result.stderr or result.stdout)[-1500:]}
    return {**row, **summarise_run(out, warmup=5)}


def run_hf_baseline(root: Path, model: Path, steps: int, quantize: bool, checkpointing: bool) -> dict:
    """transformers' Trainer + PEFT on the same model, data and settings."""
    script = REPO / "bench" / "hf_trainer_baseline.py"
    args = [sys.executable, str(script), "--model", str(model), "--steps", str(steps)]
    args += ["--qlora"] if quantize else []
    args += ["--checkpointing"] if checkpointing else []
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    name = f"hf-trainer {'qlora' if quantize else 'lora'}{'+gc' if checkpointing else ''}"
    if result.returncode != 0:
        return {"name": name, "impl": "baseline", "error": (result.stderr or result.stdout)[-1500:]}
    return {"name": name, "impl": "baseline", **json.loads(result.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="/tmp/bench-core")
    parser.add_argument("--only", choices=["llama", "glm", "baseline"], action="append")
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["llama", "glm", "baseline"])
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    all_linear = attn + ["gate_proj", "up_proj", "down_proj"]
    llama = model_dir(root / "models", "llama-1b", LLAMA_1B)
    rows = []
    if "baseline" in only:
        rows.append(run_hf_baseline(root, llama, args.steps, quantize=True, checkpointing=True))
        rows.append(run_hf_baseline(root, llama, args.steps, quantize=False, checkpointing=True))
    if "llama" in only:
        rows.append(run_ours(root, "ours qlora+gc", llama, "qlora", args.steps, True, all_linear))
        rows.append(run_ours(root, "ours lora+gc", llama, "lora", args.steps, True, all_linear))
        rows.append(run_ours(root, "ours lora", llama, "lora", args.steps, False, all_linear))
    if "glm" in only:
        glm = model_dir(root / "models", "glm4-moe-small", GLM_SMALL)
        rows.append(run_ours(root, "ours glm4_moe qlora+gc", glm, "qlora", args.steps, True, attn))
    baseline = {r["name"]: r for r in rows if r["impl"] == "baseline" and "error" not in r}
    print(f"{'run':<28}{'tokens/s':>12}{'peak GiB':>10}{'vs HF':>8}  notes")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:<28}{'-':>12}{'-':>10}{'-':>8}  ERROR {row['error'].splitlines()[-1][:80]}")
            continue
        ref_name = "hf-trainer qlora+gc" if "qlora" in row["name"] else "hf-trainer lora+gc"
        ref = baseline.get(ref_name)
        comparable = row["impl"] == "ours" and "glm" not in row["name"]  # the baseline is the Llama model
        ratio = f"{row['tokens_per_sec'] / ref['tokens_per_sec']:.2f}x" if ref and comparable else ""
        notes = ""
        if row.get("quantized_params") is not None:
            notes = f"4-bit params {row['quantized_params'] / 1e6:.0f}M of {row['total_params'] / 1e6:.0f}M"
            if row.get("unquantized_expert_bytes") is not None and "glm" in row["name"]:
                notes += f", unquantized expert bytes {row['unquantized_expert_bytes']}"
        print(f"{row['name']:<28}{row['tokens_per_sec']:>12,.0f}{row['peak_gib']:>10.2f}{ratio:>8}  {notes}")
    (root / "bench_core_gpu.json").write_text(json.dumps(rows, indent=2))
    if os.environ.get("OUT"):
        shutil.copy(root / "bench_core_gpu.json", Path(os.environ["OUT"]) / "bench_core_gpu.json")


if __name__ == "__main__":
    main()
