"""A real CUDA out-of-memory and the trainer's fallback, on a GPU.

Trains the Llama-3.2-1B-shaped model with LoRA, no gradient checkpointing, 2048-token rows and a micro-batch far
too large for the card (64 x 2048 tokens: the fp32 logits alone need ~64 GiB, and activations far more).
The fallback halves the micro-batch and doubles accumulation until a step fits, re-running the same rows,
then finishes; an OOM at the first evaluation halves the evaluation batch. Prints the oom_fallback events
and the steps' losses and peaks.

    python bench/oom_demo_gpu.py --out /tmp/oom-demo [--micro 64] [--steps 4]

With ``--processes 2`` the same run is started under ``accelerate launch`` on two GPUs: every rank runs out of
memory (a real OOM) and all agree on the smaller shape. ``--inject-rank 1 --micro 8`` instead fits, and an
OOM is injected on rank 1 alone at step 2 (``tests.faulty_trainer``): both ranks still shrink together.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_core_gpu import LLAMA_1B, model_dir  # noqa: E402

from bench import harness  # noqa: E402
from trainer.runfolder import iter_records  # noqa: E402


def corpus(root: Path, copies: int) -> Path:
    """The shipped corpus ``copies`` times over: its ~123 rows of 2048 tokens are fewer than one step of
    64-row micro-batches on two processes needs, and a run refused for too little data shows no OOM."""
    if copies <= 1:
        return REPO / "data" / "tiny_corpus.jsonl"
    path = root / f"tiny_corpus_x{copies}.jsonl"
    path.write_text((REPO / "data" / "tiny_corpus.jsonl").read_text() * copies)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/oom-demo")
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument(
        "--inject-rank", type=int, default=None, help="injected OOM at step 2 on this rank only"
    )
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    model = model_dir(root / "models", "llama-1b", LLAMA_1B)
    run = root / "run"
    cfg = {
        "paths": {"output_dir": str(run), "train_file": str(corpus(root, args.processes))},
        "model": {"name_or_path": str(model), "random_init": True},
        "training": {
            "method": "lora",
            "max_steps": args.steps,
            "micro_batch_size": args.micro,
            "gradient_accumulation_steps": 1,
            "mixed_precision": "bf16",
            "save_steps": 10_000,
        },
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": harness.ALL_LINEAR},
        "data": {"max_length": 2048, "val_fraction": 0.05},
        "eval": {"interval": 2, "batch_size": 256, "max_batches": 1},
        "memory": {"gradient_checkpointing": False, "max_oom_retries": 8},
        "logging": {"progress_bar": False},
    }
    config = root / "oom.yaml"
    config.write_text(yaml.safe_dump(cfg))
    entry = ["-m", "trainer"]
    if args.inject_rank is not None:
        entry = ["-m", "tests.faulty_trainer", "--oom", f"train:2@{args.inject_rank}"]
    launcher = [sys.executable]
    if args.processes > 1:
        launcher += [
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(args.processes),
        ]
    result = harness.run_child([*launcher, *entry, "train", "--config", str(config)], cwd=REPO)
    print(f"exit code {result.returncode}")
    if result.returncode != 0:
        print(result.stderr[-3000:])
    events = [
        e
        for e in iter_records(run / "logs" / "events.jsonl")
        if e["event"] in ("oom_fallback", "eval_skipped")
    ]
    for event in events:
        print(
            json.dumps(
                {k: event.get(k) for k in ("event", "step", "phase", "old", "new", "attempt", "rank_failed")}
            )
        )
    for record in iter_records(run / "logs" / "training_log.jsonl"):
        print(
            f"step {record['step']}: loss {record['loss']:.4f}, tokens {record['tokens']}, "
            f"peak {record['peak_mem_mb'] / 1024:.1f} GiB"
        )
    summary = {
        "returncode": result.returncode,
        "events": events,
        "steps": list(iter_records(run / "logs" / "training_log.jsonl")),
    }
    harness.write_json(root / "oom_demo.json", summary)


if __name__ == "__main__":
    main()
