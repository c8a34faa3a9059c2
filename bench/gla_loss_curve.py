"""Does GLA train the same on fla's Triton kernels as on its fp32-exact reference op? Two runs, one curve.

Why (issue 14): on Hopper the LoRA gradients through ``chunk_gla`` were 25% off the reference in an fp32
check; the cause was TF32 inside the kernel (bench/RESULTS.md). An fp32 run now trains through
``fused_recurrent_gla``, bf16 runs keep ``chunk_gla``. This trains the same GLA model (``configs/tiny-gla``
widened: ``--hidden``, ``--layers``) on the shipped corpus twice through ``python -m trainer train``, once
on each ``model.kernel_path`` (fla-triton, fla-naive-torch), same data and seed, and prints the per-step
loss difference. bf16 noise between two correct paths is ~1e-2 on a loss of ~5; a wrong backward drifts.

    python bench/gla_loss_curve.py --steps 300 --out $OUT/gla_curve.json              # GPU
    python bench/gla_loss_curve.py --steps 3 --hidden 64 --layers 1 --out /tmp/c.json  # CPU: the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PATHS = ("fla-triton", "fla-naive-torch")


def model_folder(root: Path, hidden: int, layers: int, heads: int) -> Path:
    """configs/tiny-gla (its tokenizer and config) with a wider, deeper model."""
    folder = root / "model"
    shutil.copytree(REPO / "configs" / "tiny-gla", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, intermediate_size=None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def train(root: Path, model: Path, path: str, args) -> dict:
    """One run on ``path``; its per-step losses and median tokens/s."""
    from trainer.runfolder import iter_records, last_per_step

    out = root / path
    overrides = {
        "paths.output_dir": out,
        "model.name_or_path": model,
        "model.kernel_path": path,
        "training.max_steps": args.steps,
        "training.save_steps": 10 * args.steps,
        "training.mixed_precision": args.precision,
        "training.micro_batch_size": args.batch,
        "data.max_length": args.seq,
        "eval.interval": 10 * args.steps,
        "logging.progress_bar": "false",
    }
    command = [sys.executable, "-m", "trainer", "train", "--config", str(REPO / "configs" / "tiny-gla.yaml")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    started = time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        return {"path": path, "error": (done.stderr or done.stdout)[-1500:]}
    records = last_per_step(list(iter_records(out / "logs" / "training_log.jsonl")))
    events = list(iter_records(out / "logs" / "events.jsonl"))
    report = next(e for e in events if e["event"] == "model_report")
    speeds = sorted(r["tokens_per_sec"] for r in records[3:] or records)
    return {
        "path": path,
        "kernel_path": report.get("kernel_path"),
        "wall_s": round(time.time() - started, 1),
        "tokens_per_sec": speeds[len(speeds) // 2],
        "losses": {r["step"]: r["loss"] for r in records},
    }


def compare(fast: dict, ref: dict) -> dict:
    steps = sorted(set(fast["losses"]) & set(ref["losses"]))
    diffs = [abs(fast["losses"][s] - ref["losses"][s]) for s in steps]
    tail = diffs[-max(1, len(diffs) // 10) :]
    return {
        "steps": len(steps),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "last_tenth_mean_abs_diff": sum(tail) / len(tail),
        "first": (fast["losses"][steps[0]], ref["losses"][steps[0]]),
        "last": (fast["losses"][steps[-1]], ref["losses"][steps[-1]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512, help="data.max_length (chunk_gla's chunks are 64)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "no"))
    parser.add_argument(
        "--paths", default=",".join(PATHS), help="kernel paths, the first compared to the last"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="gla-curve-"))
    model = model_folder(root, args.hidden, args.layers, args.heads)
    runs = [train(root, model, path, args) for path in args.paths.split(",")]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "model": str(model), "runs": runs}
    failed = [r for r in runs if "error" in r]
    if not failed:
        result["comparison"] = compare(runs[0], runs[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for run in runs:
        print(
            f"{run['path']}: " + (run.get("error") or f"{run['kernel_path']}, {run['tokens_per_sec']} tok/s")
        )
    if failed:
        return 1
    print("GLA-CURVE " + json.dumps(result["comparison"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
