"""GPU benchmark of packing: real (non-padding target) tokens/s of this kit packing variable-length
documents into 2048-token rows, against transformers' Trainer + PEFT + Liger padding each batch to its
longest document. Issue 13's target: at least 2x, with no token attending across documents.

The same documents for every variant: instruction-like lengths drawn log-normal (median ~250 tokens,
capped at 2048, seeded), random token ids. Llama-3.2-1B shape from a saved folder (config.json,
tokenizer, model.safetensors; ``bench/profile_fast_path.py --model DIR --save-model`` writes one),
LoRA r16 alpha 32 on all seven linears, bf16, gradient checkpointing on for both sides.

Variants, each in its own subprocess with a timeout (a failure is a row, not a crash):
  kit-sdpa   trainer.modeling.load_for_training + training.step.forward_loss, fast path on, sdpa
  kit-flex   the same with model.attn_implementation: flex_attention (block-sparse document mask)
  hf-liger   Trainer + PEFT + use_liger_kernel=True, batches right-padded to their longest document

Each kit variant first checks, on the loaded model, that a packed row's loss equals the sum of its
documents' losses computed alone (``doc_check``: relative difference, bf16 noise is ~1e-3).

    python bench/bench_packing_gpu.py --model /tmp/llama1b            # table; JSON to $OUT or --out
    python bench/bench_packing_gpu.py --model DIR --variants kit-flex --documents 600
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

IGNORE = -100
VARIANTS = ("kit-sdpa", "kit-flex", "hf-liger")
BASELINE = "hf-liger"
ATTENTION = {"kit-sdpa": "sdpa", "kit-flex": "flex_attention"}
MODEL_FILES = ("config.json", "model.safetensors")


# ---------------------------------------------------------------- the documents (CPU, unit-tested)


def sample_lengths(
    count: int, seed: int, median: float = 250, sigma: float = 1.0, cap: int = 2048, minimum: int = 8
) -> list[int]:
    """Document lengths drawn log-normal around ``median`` (its median is exp(mu)), clipped to
    [minimum, cap]: most documents short, a long tail up to the row length."""
    rng = random.Random(seed)
    mu = math.log(median)
    return [min(cap, max(minimum, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def make_documents(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    """Random token ids (3 and up: 0-2 are pad/bos/eos in the kit's tokenizers), one list per length."""
    rng = random.Random(seed + 1)
    high = min(vocab, 32000) - 1
    return [[rng.randint(3, high) for _ in range(n)] for n in lengths]


def count_targets(labels) -> int:
    """Tokens that carry a next-token label: the real tokens a step learns from (as the kit counts)."""
    return int((labels[:, 1:] != IGNORE).sum())


def pad_batch(docs: list[list[int]], pad_id: int) -> dict:
    """The baseline's batch: right-padded to its longest document, padding masked and out of the loss."""
    import torch

    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for i, doc in enumerate(docs):
        ids[i, : len(doc)] = torch.tensor(doc)
        labels[i, : len(doc)] = torch.tensor(doc)
        mask[i, : len(doc)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def kit_batches(docs: list[list[int]], max_length: int, micro: int, pad_id: int) -> list[dict]:
    """This kit's micro-batches: documents packed into rows of ``max_length`` by ``trainer.data.pack``
    (long ones split across rows), ``micro`` rows collated at a time."""
    from trainer.data.dataset import collate, pack

    rows = pack([(d, list(d)) for d in docs], max_length, pad_id)
    return [collate(rows[i : i + micro], pad_id) for i in range(0, len(rows), micro)]


def steady_rate(times: list[float], targets: list[int], warmup: int) -> dict:
    """Real tokens/s over the steps after ``warmup`` (compilation and allocator warm-up excluded)."""
    keep = slice(warmup, None) if len(times) > warmup else slice(0, None)
    seconds, tokens = sum(times[keep]), sum(targets[keep])
    return {
        "steps": len(times),
        "timed_steps": len(times[keep]),
        "real_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "median_step_s": round(statistics.median(times[keep]), 4) if times else None,
    }


# ---------------------------------------------------------------- one variant (its own process)


class Accelerator:
    """What ``forward_loss`` needs of accelerate's: a device and bf16 autocast."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)

    def autocast(self):
        import contextlib

        import torch

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16)


def documents_for(args) -> tuple[list[list[int]], dict]:
    config = json.loads((Path(args.model) / "config.json").read_text())
    lengths = sample_lengths(args.documents, args.seed, args.median, args.sigma, args.max_length)
    docs = make_documents(lengths, args.seed, config["vocab_size"])
    summary = {
        "documents": len(docs),
        "tokens": sum(lengths),
        "median_length": statistics.median(lengths),
        "mean_length": round(statistics.mean(lengths), 1),
        "max_length": max(lengths),
    }
    return docs, summary


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def kit_config(args, out: Path, attention: str):
    import yaml

    from trainer.config import load_config

    cfg = {
        "paths": {"output_dir": str(out / "run"), "train_file": str(REPO / "data" / "tiny_corpus.jsonl")},
        "model": {"name_or_path": str(args.model), "attn_implementation": attention},
        "training": {"method": "lora", "mixed_precision": "bf16", "micro_batch_size": args.micro},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": harness.ALL_LINEAR},
        "data": {"max_length": args.max_length},
        "memory": {"gradient_checkpointing": True},
        "performance": {"fast_path": "on" if args.device == "cuda" else "auto"},
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def doc_check(model, docs: list[list[int]], max_length: int, pad_id: int, accel) -> float:
    """|loss of one packed row - sum of its documents' losses alone| / the sum: ~0 (bf16 noise) when no
    token attends across documents, of the order of the loss itself when they do."""
    import torch

    from trainer.training.step import forward_loss

    fitting, used = [], 0
    for doc in docs:
        if used + len(doc) > max_length:
            break
        fitting.append(doc[:max_length])
        used += len(fitting[-1])
    fitting = fitting if len(fitting) > 1 else [d[: max_length // 4] for d in docs[:4]]
    with torch.no_grad():
        packed = float(forward_loss(model, kit_batches(fitting, max_length, 1, pad_id)[0], accel)[0])
        alone = sum(
            float(forward_loss(model, kit_batches([d], len(d), 1, pad_id)[0], accel)[0]) for d in fitting
        )
    return abs(packed - alone) / abs(alone)


def run_kit(args, variant: str) -> dict:
    import torch

    from trainer.fastpath import attention as fast_attention
    from trainer.model.loading import load_for_training
    from trainer.training.step import forward_loss

    device = torch.device(args.device)
    docs, summary = documents_for(args)
    cfg = kit_config(args, Path(args.work) / variant, ATTENTION[variant])
    torch.manual_seed(0)
    loaded = load_for_training(cfg, device)
    model = loaded.model.to(device).train()
    pad_id = loaded.tokenizer.pad_token_id or 0
    accel = Accelerator(args.device)
    check = doc_check(model, docs, args.max_length, pad_id, accel)
    batches = kit_batches(docs, args.max_length, args.micro, pad_id)[: args.max_steps]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, targets, losses, density = [], [], [], []
    for batch in batches:
        density.append(fast_attention.block_density(batch["position_ids"]))
        synchronize(device)
        started = time.perf_counter()
        ce, _ = forward_loss(model, batch, accel)
        n = count_targets(batch["labels"])
        (ce / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - started)
        targets.append(n)
        losses.append(float(ce) / n)
    computed = sum(b["input_ids"].numel() for b in batches)
    return {
        **steady_rate(times, targets, args.warmup),
        **summary,
        "peak_gib": peak_gib(device),
        "tokens_computed_per_target": round(computed / sum(targets), 3),
        "attention": fast_attention.current(model),
        "flex_block_density": round(statistics.mean(density), 3),
        "fast_path": loaded.report.get("fast_path", {}).get("enabled"),
        "doc_check_rel_diff": round(check, 6),
        "final_loss": round(losses[-1], 4),
    }


def run_hf(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    device = torch.device(args.device)
    docs, summary = documents_for(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cuda = device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        dtype=torch.bfloat16 if cuda else torch.float32,
        attn_implementation="sdpa",
        device_map={"": 0} if cuda else None,
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=harness.ALL_LINEAR, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora)
    targets: list[int] = []
    computed: list[int] = []

    def collate(features):  # batches are made in order, so batch i is step i
        batch = pad_batch([f["input_ids"] for f in features], pad_id)
        targets.append(count_targets(batch["labels"]))
        computed.append(batch["input_ids"].numel())
        return batch

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            synchronize(device)
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            synchronize(device)
            times.append(time.perf_counter() - self.started)

    steps = min(math.ceil(len(docs) / args.hf_batch), args.max_steps)
    training_args = TrainingArguments(
        output_dir=str(Path(args.work) / "hf"),
        per_device_train_batch_size=args.hf_batch,
        max_steps=steps,
        bf16=cuda,
        use_cpu=not cuda,
        learning_rate=1e-4,
        logging_steps=max(1, steps // 5),
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_liger_kernel=cuda and not args.no_liger,
        gradient_checkpointing=False,  # enabled above, as the anchor script does
        seed=args.seed,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dataset = [{"input_ids": d} for d in docs]
    result = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[Timer()]
    ).train()
    n = len(times)
    return {
        **steady_rate(times, targets[:n], args.warmup),
        **summary,
        "peak_gib": peak_gib(device),
        "tokens_computed_per_target": round(sum(computed[:n]) / sum(targets[:n]), 3),
        "attention": "sdpa",
        "liger": training_args.use_liger_kernel,
        "hf_batch": args.hf_batch,
        "final_loss": round(result.training_loss, 4),
    }


# ---------------------------------------------------------------- the parent: one subprocess per variant


def child_command(args, variant: str) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--variant", variant]
    for key in ("model", "work", "documents", "seed", "median", "sigma", "max_length", "micro"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key in ("hf_batch", "max_steps", "warmup", "device"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return command + (["--no-liger"] if args.no_liger else [])


def last_line(text: str) -> str:
    """The line that says what went wrong (a traceback's last), not the frames before it."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else "no output"


def run_variant(args, variant: str, timeout: float) -> dict:
    """One variant in a fresh process (its own CUDA context, compile caches and peak memory)."""
    started = time.time()
    env = harness.child_env(TOKENIZERS_PARALLELISM="false")
    done = harness.run_child(child_command(args, variant), timeout, cwd=REPO, env=env)
    if done.returncode == harness.TIMED_OUT:
        return {"variant": variant, "error": f"timed out after {timeout:.0f}s"}
    row = {"variant": variant, "wall_s": round(time.time() - started, 1)}
    found = harness.result_lines(done.stdout, "RESULT ")
    if found:
        return {**row, **found[0]}
    output = done.stderr or done.stdout
    return {**row, "error": f"exit {done.returncode}: {last_line(output)}", "output_tail": output[-3000:]}


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["variant"] == BASELINE and r.get("real_tokens_per_s")), None)
    lines = [
        f"{'variant':<10}{'real tok/s':>12}{'vs hf':>8}{'step s':>9}{'peak GiB':>10}{'computed/real':>15}"
        f"{'attention':>16}{'doc check':>11}",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['variant']:<10}  ERROR {row['error'][:200]}")
            continue
        rate = row["real_tokens_per_s"]
        ratio = f"{rate / base['real_tokens_per_s']:.2f}x" if base and rate else "-"
        peak = "-" if row.get("peak_gib") is None else f"{row['peak_gib']:.2f}"
        check = "-" if "doc_check_rel_diff" not in row else f"{row['doc_check_rel_diff']:.1e}"
        lines.append(
            f"{row['variant']:<10}{rate:>12,.0f}{ratio:>8}{row['median_step_s']:>9.3f}{peak:>10}"
            f"{row['tokens_computed_per_target']:>15.2f}{row['attention']:>16}{check:>11}"
        )
    return "\n".join(lines)


def check_model_folder(folder: Path) -> str | None:
    for name in MODEL_FILES:
        if not (folder / name).is_file():
            return f"--model: {folder / name} is missing (bench/profile_fast_path.py --model DIR --save-model writes one)"
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return f"--model: no tokenizer in {folder} (expected tokenizer.json)"
    return None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help="saved model folder: config.json, tokenizer, model.safetensors"
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--documents", type=int, default=1200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--median", type=float, default=250)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=2048, help="row length (kit) and document cap (both)")
    p.add_argument("--micro", type=int, default=4, help="packed rows per kit micro-batch")
    p.add_argument("--hf-batch", type=int, default=16, help="documents per baseline batch")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the rate")
    p.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of the script")
    p.add_argument("--no-liger", action="store_true", help="baseline without Liger (liger-kernel missing)")
    p.add_argument("--work", default="/tmp/bench-packing")
    p.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for bench_packing.json (default $OUT)"
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    problem = check_model_folder(Path(args.model))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.variant:  # a child: one variant, one RESULT line
        result = run_hf(args) if args.variant == BASELINE else run_kit(args, args.variant)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"--variants: unknown {', '.join(unknown)} (have: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    rows = []
    for variant in variants:
        rows.append(run_variant(args, variant, args.timeout))
        print(f"{variant}: {json.dumps(rows[-1])}", flush=True)
    print(table(rows))
    base = next((r for r in rows if r["variant"] == BASELINE and r.get("real_tokens_per_s")), None)
    for row in rows:
        if base and row.get("real_tokens_per_s") and row["variant"] != BASELINE:
            row["ratio_vs_hf_liger"] = round(row["real_tokens_per_s"] / base["real_tokens_per_s"], 3)
    if args.out:
        harness.write_json(Path(args.out) / "bench_packing.json", {"args": vars(args), "rows": rows})
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
