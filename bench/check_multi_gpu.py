"""Two-GPU check: `accelerate launch --num_processes 2` writes one coherent run folder, and the
token-normalised loss matches a one-GPU run over the same rows (micro-batch 4 on one GPU = 2 x 2 on two).

    python bench/check_multi_gpu.py --out /tmp/mgpu [--model configs/tiny-moe] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from trainer.runfolder import iter_records, last_per_step  # noqa: E402


def config(out: Path, model: str, micro: int, steps: int, random_init: bool) -> Path:
    cfg = {
        "paths": {"output_dir": str(out), "train_file": str(REPO / "data" / "tiny_corpus.jsonl")},
        "model": {"name_or_path": model, "random_init": random_init, "dtype": "fp32"},
        "training": {
            "method": "lora",
            "max_steps": steps,
            "micro_batch_size": micro,
            "save_steps": steps // 2,
            "mixed_precision": "no",
        },
        "lora": {"dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]},
        "data": {"max_length": 256},
        "eval": {"interval": steps // 2},
        "logging": {"progress_bar": False, "telemetry_interval": 1},
        "performance": {"tf32": False},  # exact fp32 so one and two GPUs can be compared closely
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cmd: list[str]) -> float:
    started = time.time()
    result = harness.run_child(cmd, cwd=REPO)
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/mgpu")
    parser.add_argument("--model", default=str(REPO / "configs" / "tiny-moe"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    one, two = root / "one-gpu", root / "two-gpu"
    env_one = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--config",
            str(config(one, args.model, 4, args.steps, True)),
        ],
        cwd=REPO,
        env=env_one,
        check=True,
        capture_output=True,
    )
    wall_one = time.time() - started
    wall_two = run(
        [
            "accelerate",
            "launch",
            "--num_processes",
            "2",
            "--multi_gpu",
            "-m",
            "trainer",
            "train",
            "--config",
            str(config(two, args.model, 2, args.steps, True)),
        ]
    )
    info = json.loads((two / "run.json").read_text())
    train = list(iter_records(two / "logs" / "training_log.jsonl"))
    events = [e["event"] for e in iter_records(two / "logs" / "events.jsonl")]
    devices = sorted({r["device"] for r in iter_records(two / "logs" / "gpu_log.jsonl")})
    ref = {r["step"]: r for r in last_per_step(list(iter_records(one / "logs" / "training_log.jsonl")))}
    diffs = [abs(r["loss"] - ref[r["step"]]["loss"]) for r in train]
    checks = {
        "world_size_2": info["world_size"] == 2,
        "status_finished": info["status"] == "finished",
        "steps_contiguous_no_duplicates": [r["step"] for r in train] == list(range(1, args.steps + 1)),
        "one_run_start_one_run_end": events.count("run_start") == 1 and events.count("run_end") == 1,
        "gpu_log_has_both_devices": {"cuda:0", "cuda:1"} <= set(devices),
        "tokens_match_one_gpu": all(r["tokens"] == ref[r["step"]]["tokens"] for r in train),
        "loss_matches_one_gpu_1e-4": max(diffs) < 1e-4,
        "checkpoints": sorted(p.name for p in two.glob("*checkpoint-*")),
    }
    result = {
        "checks": checks,
        "max_loss_diff": max(diffs),
        "wall_one_gpu_s": round(wall_one, 1),
        "wall_two_gpu_s": round(wall_two, 1),
        "devices": devices,
    }
    print(json.dumps(result, indent=2))
    harness.write_json(root / "multi_gpu.json", result)


if __name__ == "__main__":
    main()
