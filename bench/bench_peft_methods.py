"""GPU comparison of LoRA, SDLoRA and LoRA-GA on a small Mamba-2 and one GLUE-style task (issue 17).

Each method trains through the kit's own CLI (``python -m trainer train``) with the same data, seed,
steps and LoRA rank, in its own run folder under ``--out``; the script then reads the run folders:
loss curve, final task metric (sst2 accuracy, generation-based), trainable parameters (the model
report's LoRA count, plus SDLoRA's selected SSM values from its ``sdlora_selection`` event), median
tokens/s, and LoRA-GA's init time and step-0 check. The task is generated (no download): SST-2-shaped
TSVs whose label follows sentiment words, in ``<out>/glue/SST-2``, plus the same rows as instruction
records (the task's own prompt and label word) for training.

    python bench/bench_peft_methods.py --out $OUT/peft --steps 300            # ~50M Mamba-2, bf16, GPU
    python bench/bench_peft_methods.py --out $OUT/peft --model /models/mamba2-130m --steps 300
    python bench/bench_peft_methods.py --out /tmp/peft --smoke                  # tiny, 40 steps, CPU ok

Writes ``<out>/peft_methods.json`` and prints a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

# ~50M parameters with the tiny tokenizer's 1024 tokens: big enough for the fast kernels to matter.
MAMBA2_SMALL = {
    "model_type": "mamba2",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "state_size": 64,
    "expand": 2,
    "head_dim": 64,
    "num_heads": 24,
    "n_groups": 1,
    "chunk_size": 64,
    "conv_kernel": 4,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    **harness.TOKEN_IDS,
}
POSITIVE = ["good", "great", "warm", "fine", "lovely", "bright", "funny", "smart", "moving", "clever"]
NEGATIVE = ["bad", "dull", "cold", "weak", "boring", "grim", "flat", "silly", "slow", "stale"]
FILLER = [
    "the",
    "film",
    "story",
    "cast",
    "plot",
    "was",
    "quite",
    "a",
    "very",
    "and",
    "with",
    "its",
    "ending",
    "music",
]
# Run sizes: the GPU comparison, and --smoke (the tiny Mamba-2 on a CPU: long enough that every answer is a
# label word the evaluation reads; its accuracy stays near chance, the tiny random-init model needs more).
FULL = {"steps": 300, "batch": 32, "lr": 1e-3, "train_rows": 8000, "dev": 400}
SMOKE = {"steps": 40, "batch": 8, "lr": 3e-3, "train_rows": 320, "dev": 32}
METHODS = {
    "lora": {},
    "sdlora": {"method": "sdlora", "sdlora_stage_one_steps": 20},
    "lora_ga": {"init": "lora_ga", "lora_ga_batches": 8},
}


def sentence(rng: random.Random, label: int) -> str:
    words = [rng.choice(FILLER) for _ in range(rng.randint(4, 10))]
    for _ in range(rng.randint(1, 2)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
    return " ".join(words)


def write_task(root: Path, train_rows: int, dev_rows: int, seed: int) -> tuple[Path, Path]:
    """SST-2/{train,dev}.tsv under ``root``/glue, and the training rows as instruction records (the task's
    own prompt and label word, so training teaches exactly what the evaluation asks)."""
    from trainer.tasks.glue import GlueTask

    rng = random.Random(seed)
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train_rows), ("dev", dev_rows)):
        lines = ["sentence\tlabel"] + [f"{sentence(rng, i % 2)}\t{i % 2}" for i in range(n)]
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    task = GlueTask("sst2", root / "glue")
    records = [{"prompt": task.prompt(e), "response": task.target(e)} for e in task.load("train")]
    train = root / "sst2_train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "glue", train


def write_model(root: Path, smoke: bool) -> Path:
    """A random-init Mamba-2 folder: the small config (or the tiny one) with the tiny tokenizer."""
    tiny = REPO / "configs" / "tiny-mamba2"
    config = json.loads((tiny / "config.json").read_text()) if smoke else MAMBA2_SMALL
    return harness.model_folder(root / "model", config, tokenizer=tiny)


def lengths(model: Path, glue: Path, train: Path) -> dict:
    """Token counts that size the runs, with the model's own tokenizer: ``max_length`` holds the longest
    training record whole (bos + prompt + label word + eos), rounded up to 8; ``max_new_tokens`` holds the
    longest label word plus eos.

    Why: a record longer than ``max_length`` is split into windows (packing off), and the window that holds
    the label word then no longer holds the sentence, so no run can learn the task (the loss floors at
    ln 2 over the label's tokens); and an answer cut before its label word ends never names a label, so
    every evaluation reads 0 with all answers ``unparsed``. Both happened at 64 and 3 tokens."""
    from transformers import AutoTokenizer

    from trainer.config import DataConfig
    from trainer.data.records import Encoder
    from trainer.tasks.glue import GlueTask

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    records = [json.loads(line) for line in train.read_text().splitlines()]
    # The kit's own encoding: bos + prompt + response + eos.
    encoder = Encoder(tokenizer, DataConfig(), "instruction")
    longest = max(len(e.ids) for e in encoder.encode(records))
    words = GlueTask("sst2", glue).spec.label_words
    answer = max(len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) for w in words) + 1
    return {"max_length": -(-longest // 8) * 8, "max_new_tokens": answer, "longest_record": longest}


def run_config(
    args, method: str, model: Path, random_init: bool, glue: Path, train: Path, sizes: dict
) -> Path:
    run = args.out / method
    cfg = {
        "paths": {"output_dir": str(run), "train_file": str(train)},
        "model": {"name_or_path": str(model), "random_init": random_init},
        "training": {
            "method": "lora",
            "max_steps": args.steps,
            "micro_batch_size": args.batch,
            "save_steps": max(1, args.steps // 2),
            "seed": args.seed,
            "mixed_precision": "no" if args.smoke else "bf16",
        },
        "optimization": {"learning_rate": args.lr, "lr_scheduler": "cosine", "warmup_ratio": 0.05},
        "lora": {"r": args.r, "alpha": 2 * args.r, "dropout": 0.0, "target_modules": ["in_proj", "lm_head"]}
        | METHODS[method],
        "data": {"max_length": sizes["max_length"], "val_fraction": 0.02, "packing": False},
        "eval": {
            "interval": max(1, args.steps // 5),
            "batch_size": 32,
            "task": "sst2",
            "task_data_dir": str(glue),
            "task_max_examples": args.dev,
            "max_new_tokens": sizes["max_new_tokens"],
            "generation_batch_size": 64,
        },
        "logging": {"progress_bar": False, "telemetry_interval": 5},
    }
    if args.smoke:
        cfg["lora"].update(sdlora_stage_one_steps=2, lora_ga_batches=2)
    path = args.out / f"{method}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def summary(run: Path) -> dict:
    from trainer.runfolder import EVAL_LOG, EVENTS_LOG, TRAINING_LOG, iter_records, last_per_step

    train = last_per_step(list(iter_records(run / "logs" / TRAINING_LOG)))
    evals = last_per_step(list(iter_records(run / "logs" / EVAL_LOG)))
    events = list(iter_records(run / "logs" / EVENTS_LOG))
    report = next(e for e in events if e["event"] == "model_report")
    selection = next((e for e in events if e["event"] == "sdlora_selection"), None)
    init = next((e for e in events if e["event"] == "lora_ga_init"), None)
    final = evals[-1] if evals else {}
    rates = [r["tokens_per_sec"] for r in train[len(train) // 5 :] if r.get("tokens_per_sec")]
    return {
        "losses": {r["step"]: r["loss"] for r in train},
        "final_loss": train[-1]["loss"] if train else None,
        "eval": [
            {"step": e["step"], "eval_loss": e.get("eval_loss"), **(e.get("metrics") or {})} for e in evals
        ],
        "final_accuracy": (final.get("metrics") or {}).get("accuracy"),
        "lora_params": report["trainable_params"],
        "ssm_values": selection["selected_values"] if selection else 0,
        "tokens_per_sec": statistics.median(rates) if rates else None,
        "kernel_path": report.get("kernel_path"),
        "stage_one_seconds": selection["stage_one_seconds"] if selection else None,
        "lora_ga": {k: init[k] for k in ("seconds", "step0_loss_base", "step0_loss_lora_ga")}
        if init
        else None,
    }


def table(results: dict) -> str:
    header = ["method", "trainable (LoRA + SSM values)", "final loss", "sst2 accuracy", "tokens/s", "extra"]
    rows = []
    for method, r in results.items():
        if "error" in r:
            rows.append([method, "-", "-", "-", "-", f"failed: {r['error']}"])
            continue
        extra = ""
        if r["stage_one_seconds"] is not None:
            extra = f"stage one {r['stage_one_seconds']:.1f}s"
        if r["lora_ga"]:
            g = r["lora_ga"]
            extra = f"init {g['seconds']:.1f}s, step-0 loss {g['step0_loss_base']:.5f} -> {g['step0_loss_lora_ga']:.5f}"
        acc = "-" if r["final_accuracy"] is None else f"{r['final_accuracy']:.3f}"
        tps = "-" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}"
        trainable = f"{r['lora_params']:,} + {r['ssm_values']:,}"
        rows.append([method, trainable, f"{r['final_loss']:.4f}", acc, tps, extra])
    return harness.markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--model", help="a local Mamba-2 folder (pretrained); default: a random-init ~50M one"
    )
    parser.add_argument("--steps", type=int, help=f"default {FULL['steps']} ({SMOKE['steps']} with --smoke)")
    parser.add_argument("--batch", type=int, help=f"default {FULL['batch']} ({SMOKE['batch']} with --smoke)")
    parser.add_argument("--lr", type=float, help=f"default {FULL['lr']} ({SMOKE['lr']} with --smoke)")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument(
        "--train-rows", type=int, help=f"default {FULL['train_rows']} ({SMOKE['train_rows']} with --smoke)"
    )
    parser.add_argument("--dev", type=int, help=f"default {FULL['dev']} ({SMOKE['dev']} with --smoke)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny Mamba-2 in fp32, 40 steps: checks the script end to end on a CPU",
    )
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    glue, train = write_task(args.out, args.train_rows, args.dev, args.seed)
    model = Path(args.model) if args.model else write_model(args.out, args.smoke)
    sizes = lengths(model, glue, train)
    print(
        f"records up to {sizes['longest_record']} tokens: max_length {sizes['max_length']}, "
        f"max_new_tokens {sizes['max_new_tokens']}",
        flush=True,
    )
    results = {}
    for method in args.methods:
        config = run_config(args, method, model, args.model is None, glue, train, sizes)
        done = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config)], cwd=REPO)
        if done.returncode != 0:
            results[method] = {"error": f"exit {done.returncode}"}
            continue
        results[method] = summary(args.out / method)
    harness.write_json(args.out / "peft_methods.json", results, indent=1)
    print(table(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
