"""The tiny family configs through the CLI in every precision and method a GPU run may take (issue 30, item 1).

Each case is ``python -m trainer train --config configs/<name>.yaml`` with a few ``--set`` overrides, in its own
subprocess (several at once), and reports its exit code, the ``kernels:`` line, the last logged loss and its
wall time. The Mamba-1 cases are the ways a bf16 run reaches transformers' scan: bf16 weights without autocast
(``training.mixed_precision: no``, ``model.dtype`` bf16, or ``auto`` on a GPU: the config as shipped), under
autocast over bf16 or fp32 weights, fp32 throughout, LoRA and QLoRA, on each kernel path this machine has.

    python bench/tiny_family_matrix.py --out $OUT/matrix.json --steps 20 --parallel 6
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

# (name, config, overrides): model.dtype auto is bf16 on a GPU with bf16 support
CASES = [
    ("mamba1 lora auto-dtype (as shipped)", "tiny-mamba", []),
    ("mamba1 lora bf16 + autocast", "tiny-mamba", ["training.mixed_precision=bf16"]),
    ("mamba1 lora fp32 + autocast", "tiny-mamba", ["model.dtype=fp32", "training.mixed_precision=bf16"]),
    ("mamba1 lora fp32", "tiny-mamba", ["model.dtype=fp32"]),
    ("mamba1 qlora bf16", "tiny-mamba", ["training.method=qlora", "lora.target_modules=[in_proj,x_proj]"]),
    (
        "mamba1 qlora bf16 + autocast",
        "tiny-mamba",
        ["training.method=qlora", "lora.target_modules=[in_proj,x_proj]", "training.mixed_precision=bf16"],
    ),
    (
        "mamba1 qlora fp32",
        "tiny-mamba",
        [
            "training.method=qlora",
            "lora.target_modules=[in_proj,x_proj]",
            "model.dtype=fp32",
            "quantization.compute_dtype=fp32",
        ],
    ),  # fmt: skip
    ("mamba1 lora bf16 torch-reference", "tiny-mamba", ["model.kernel_path=torch-reference"]),
    ("mamba1 lora bf16 mamba_ssm", "tiny-mamba", ["model.kernel_path=mamba_ssm"]),
    ("mamba2 lora auto-dtype (as shipped)", "tiny-mamba2", []),
]


def run_case(case, steps: int, root: Path) -> dict:
    name, config, sets = case
    out = root / name.replace(" ", "_").replace("(", "").replace(")", "")
    command = [sys.executable, "-m", "trainer", "train", "--config", f"configs/{config}.yaml"]
    for item in [
        f"paths.output_dir={out}",
        f"training.max_steps={steps}",
        f"training.save_steps={steps}",
        f"eval.interval={steps}",
        "logging.progress_bar=false",
        *sets,
    ]:
        command += ["--set", item]
    start = time.time()
    proc = harness.run_child(command, cwd=REPO)
    lines = (proc.stdout + proc.stderr).splitlines()
    log = out / "logs" / "training_log.jsonl"
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "case": name,
        "returncode": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "kernels": next((line for line in lines if line.startswith("kernels:")), None),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": len(losses),
        "error": next(
            (line for line in reversed(lines) if "Error" in line or line.startswith("error:")), None
        )
        if proc.returncode
        else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if args.only in c[0]]
    with tempfile.TemporaryDirectory(prefix="tiny-matrix-") as tmp, ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda case: run_case(case, args.steps, Path(tmp)), cases))
    for r in results:
        print(
            f"{r['case']:40} rc={r['returncode']} {r['wall_s']:6.1f}s loss {r['first_loss']} -> {r['last_loss']} "
            f"| {r['kernels']} {('| ' + r['error']) if r['error'] else ''}",
            flush=True,
        )
    if args.out:
        harness.write_json(args.out, results)
    return 0 if all(r["returncode"] == 0 for r in results if "mamba_ssm" not in r["case"]) else 1


if __name__ == "__main__":
    sys.exit(main())
