"""Does GLA train the same on fla's Triton kernels as on its fp32-exact reference op? Two runs, one curve.

Why (issue 14): on Hopper the LoRA gradients through ``chunk_gla`` were 25% off the reference in an fp32
check; the cause was TF32 inside the kernel (bench/RESULTS.md). An fp32 run now trains through
``fused_recurrent_gla``, bf16 runs keep ``chunk_gla``. This trains the same GLA model (``configs/tiny-gla``
widened: ``--hidden``, ``--layers``) on the shipped corpus twice through ``python -m trainer train``, once
on each ``model.kernel_path`` (fla-triton, fla-naive-torch), same data and seed, and prints the per-step
loss difference; ``--noise-floor`` adds the reference path in fp32, whose distance from the same path in bf16
is what bf16 rounding alone does to the curve. Runs go side by side; one still going at ``--timeout`` is
stopped and the steps both reached are compared.

    python bench/gla_loss_curve.py --steps 300 --noise-floor --timeout 500 --out $OUT/gla_curve.json  # GPU
    python bench/gla_loss_curve.py --steps 3 --hidden 64 --layers 1 --out /tmp/c.json  # CPU: the script
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

PATHS = ("fla-triton", "fla-naive-torch")


def model_folder(root: Path, hidden: int, layers: int, heads: int) -> Path:
    """configs/tiny-gla (its tokenizer and config) with a wider, deeper model."""
    tiny = REPO / "configs" / "tiny-gla"
    config = json.loads((tiny / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, intermediate_size=None)
    return harness.model_folder(root / "model", config, tokenizer=tiny)


def launch(
    root: Path, model: Path, name: str, path: str, precision: str, args
) -> tuple[Path, subprocess.Popen]:
    """Start one run on ``path`` in ``precision`` (runs go side by side: their speed is not the point)."""
    out = root / name
    overrides = {
        "paths.output_dir": out,
        "model.name_or_path": model,
        "model.kernel_path": path,
        "training.max_steps": args.steps,
        "training.save_steps": 10 * args.steps,
        "training.mixed_precision": f"'{precision}'",  # quoted: YAML reads a bare no as false
        "training.micro_batch_size": args.batch,
        "data.max_length": args.seq,
        "eval.interval": 10 * args.steps,
        "logging.progress_bar": "false",
    }
    command = [sys.executable, "-m", "trainer", "train", "--config", str(REPO / "configs" / "tiny-gla.yaml")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    log = open(root / f"{name}.log", "w")
    return out, subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def collect(name: str, out: Path, process: subprocess.Popen, deadline: float) -> dict:
    """The run's per-step losses and median tokens/s; a run still going at ``deadline`` is stopped and
    what it logged so far is kept (compared over the steps both runs reached)."""
    from trainer.runfolder import iter_records, last_per_step

    try:
        process.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log_file = out / "logs" / "training_log.jsonl"
    records = last_per_step(list(iter_records(log_file))) if log_file.is_file() else []
    if not records:
        tail = (out.parent / f"{name}.log").read_text()[-1500:]
        return {"name": name, "error": tail or f"exit {process.returncode}, nothing logged"}
    events = list(iter_records(out / "logs" / "events.jsonl"))
    report = next(e for e in events if e["event"] == "model_report")
    speeds = sorted(r["tokens_per_sec"] for r in records[3:] or records)
    return {
        "name": name,
        "kernel_path": report.get("kernel_path"),
        "finished": process.returncode == 0,
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
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="also train the last path in fp32: its distance from the same path in bf16 is bf16's own",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds; then compare what was logged")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="gla-curve-"))
    model = model_folder(root, args.hidden, args.layers, args.heads)
    paths = args.paths.split(",")
    plan = [(f"{i}-{path}-{args.precision}", path, args.precision) for i, path in enumerate(paths)]
    if args.noise_floor:
        plan.append((f"{len(plan)}-{paths[-1]}-fp32", paths[-1], "no"))
    started = [(name, *launch(root, model, name, path, precision, args)) for name, path, precision in plan]
    deadline = time.time() + args.timeout
    runs = [collect(name, out, process, deadline) for name, out, process in started]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "model": str(model), "runs": runs}
    failed = [r for r in runs if "error" in r]
    if not failed:
        result["comparison"] = compare(runs[0], runs[len(paths) - 1])
        if args.noise_floor:
            result["noise_floor"] = compare(runs[-2], runs[-1])
    harness.write_json(args.out, result, indent=1)
    for run in runs:
        done = (
            f"{run.get('kernel_path')}, {len(run.get('losses', ()))} steps, {run.get('tokens_per_sec')} tok/s"
        )
        print(f"{run['name']}: " + (run.get("error") or done))
    if failed:
        return 1
    print("GLA-CURVE " + json.dumps(result["comparison"]))
    if args.noise_floor:
        print("NOISE-FLOOR " + json.dumps(result["noise_floor"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
