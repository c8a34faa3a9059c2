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
    python bench/bench_core_gpu.py --only "" --loss-steps 200 --out /tmp/bench   # fast vs reference alone
    python bench/bench_core_gpu.py --only "" --resume-check --out /tmp/bench   # SIGKILL mid-run, resume
    python bench/bench_core_gpu.py --anchors .anchors --repeat 3 --impl ours,unsloth   # medians of 3, alternating
    python bench/bench_core_gpu.py --only glm --impl ours,hf --out /tmp/bench           # MoE QLoRA vs Trainer+PEFT
    python bench/bench_core_gpu.py --only "" --optimizer-check adamw_8bit,paged_adamw_8bit --out /tmp/bench

The host CPU of the GPU machines varies up to 2x between processes, so one run per cell is noisy: ``--repeat N``
runs the kit and Unsloth N times, alternating, and reports medians with the range of the paired ratio.
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

from bench import harness  # noqa: E402
from bench.harness import ALL_LINEAR  # noqa: E402
from bench.optimizer_state import OPTIMIZERS, checkpoint_optimizer_check  # noqa: E402

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
    **harness.TOKEN_IDS,
}
QWEN3_06B = {  # the same fields in the same order, Qwen3-0.6B's values
    **LLAMA_1B,
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}  # fmt: skip
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
    **harness.TOKEN_IDS,
}


def model_dir(root: Path, name: str, config: dict, weights: bool = False) -> Path:
    """A local model folder: config.json plus the shipped offline tokenizer (its ids are valid in any vocab);
    with ``weights``, random-init weights saved once in bf16 so every run loads them in seconds."""
    folder = harness.model_folder(root / name, config)
    if weights and not (folder / "model.safetensors").exists():
        harness.save_random_weights(folder)
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
        "cuda_graphs": (report.get("fast_path") or {}).get("cuda_graphs"),
        "moe_experts_grouped": (report.get("fast_path") or {}).get("moe_experts_grouped"),
        "losses": [r["loss"] for r in records],
    }


def run_ours(
    root: Path,
    name: str,
    model: Path,
    method: str,
    steps: int,
    checkpointing: bool,
    targets,
    timeout: float = 900,
    **extra,
) -> dict:
    out = root / name.replace(" ", "_").replace("+", "-")
    shutil.rmtree(out, ignore_errors=True)
    config = trainer_config(out, model, method, steps, checkpointing, targets, **extra)
    started = time.time()
    command = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    result = harness.run_child(command, timeout, cwd=REPO)
    row = {"name": name, "impl": "ours", "run_dir": str(out), "wall_s": round(time.time() - started, 1)}
    if result.returncode == harness.TIMED_OUT:  # a row, so the other settings of the call still print
        return {**row, "error": f"timed out after {timeout:.0f} s: {harness.output_tail(result, 300)}"}
    if result.returncode != 0:
        return {**row, "error": harness.output_tail(result, 1500)}
    replayed = "replay from graphs now" in (result.stdout or "")  # layer_graphs says so once it captured
    why_not = [line for line in (result.stderr or "").splitlines() if "CUDA graphs are off" in line]
    graphs = {"graphs_replayed": replayed, **({"graphs_off": why_not[0][-600:]} if why_not else {})}
    return {**row, **summarise_run(out, warmup=5), **graphs}


def run_hf(
    model: Path,
    steps: int,
    quantize: bool,
    checkpointing: bool,
    liger: bool,
    targets: list[str] | None = None,
) -> dict:
    """transformers' Trainer + PEFT (optionally with Liger's kernels) on the same model, rows and settings."""
    args = [sys.executable, str(REPO / "bench" / "hf_trainer_baseline.py"), "--model", str(model)]
    args += ["--train-file", str(long_documents(model.parent.parent))]
    args += ["--steps", str(steps)] + ["--qlora"] * quantize + ["--checkpointing"] * checkpointing
    args += ["--liger"] * liger + (["--targets", ",".join(targets)] if targets else [])
    result = harness.run_child(args, 600, cwd=REPO)
    if result.returncode == harness.TIMED_OUT:
        return {"error": "timed out"}
    if result.returncode != 0:
        return {"error": harness.output_tail(result, 1500)}
    return json.loads(result.stdout.strip().splitlines()[-1])


SETTINGS = {"lora+gc": ("lora", True), "qlora+gc": ("qlora", True), "lora": ("lora", False)}
UNSLOTH_VARIANTS = {
    "lora+gc": "unsloth-lora-bf16",
    "qlora+gc": "unsloth-qlora-nf4",
    "lora": "unsloth-lora-bf16-nogc",
}


def run_unsloth(
    anchors: Path, steps: int, model: Path | None = None, settings: tuple[str, ...] = tuple(SETTINGS)
) -> dict[str, dict]:
    """Unsloth's settings through the shared anchor script (each in its own process there).

    ``model``: a model folder other than the anchor's own Llama-1B (the Qwen3 row), as its MODEL_DIR."""
    env = {**os.environ, "STEPS": str(steps), "ONLY": ",".join(UNSLOTH_VARIANTS[s] for s in settings)}
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
            setting = {v: k for k, v in UNSLOTH_VARIANTS.items()}[row["name"]]
            rows[setting] = {
                "tokens_per_sec": row.get("tokens_per_s"),
                "peak_gib": row.get("peak_gib"),
                **row,
            }
    return rows


SHAPES = {"llama": ("llama-1b", LLAMA_1B), "qwen3": ("qwen3-0.6b", QWEN3_06B)}
ATTENTION = ALL_LINEAR[:4]  # glm4_moe's experts are fused 3-D parameters in transformers 5, not nn.Linear


def aggregate_runs(runs: list[dict]) -> dict:
    """One cell from N repeats: median tokens/s, max peak GiB, each repeat's figures under ``*_runs`` in repeat
    order (None where that repeat failed), so repeat i of two implementations can be paired, and each repeat's
    whole row under ``runs``. A single run is returned as it is: one repeat reports what it always did."""
    if len(runs) == 1:
        return runs[0]

    def ok(run: dict) -> bool:
        return "error" not in run and bool(run.get("tokens_per_sec"))

    cell = {
        "repeats": len(runs),
        "tokens_per_sec_runs": [run["tokens_per_sec"] if ok(run) else None for run in runs],
        "peak_gib_runs": [run.get("peak_gib") if ok(run) else None for run in runs],
        "runs": runs,
    }
    errors = [run.get("error", "no tokens/s") for run in runs if not ok(run)]
    good = [run for run in runs if ok(run)]
    if not good:
        return {**cell, "error": errors[-1]}
    peaks = [run["peak_gib"] for run in good if run.get("peak_gib") is not None]
    return {
        "tokens_per_sec": round(statistics.median(run["tokens_per_sec"] for run in good), 1),
        "peak_gib": max(peaks) if peaks else None,
        **cell,
        **({"errors": errors} if errors else {}),
    }


def paired_ratio_range(a: dict, b: dict, key: str = "tokens_per_sec") -> tuple[float, float] | None:
    """Min and max over repeats of a[i] / b[i] (repeat i of one against repeat i of the other, run back to
    back on the same host), or None when there are no repeats to pair."""
    pairs = [x / y for x, y in zip(a.get(f"{key}_runs") or [], b.get(f"{key}_runs") or []) if x and y]
    return (min(pairs), max(pairs)) if pairs else None


def format_ratio(a: dict, b: dict, key: str = "tokens_per_sec", with_range: bool = False) -> str:
    """'1.05x' (ratio of the cells' figures: medians when repeated), with ' 0.98-1.12' after it when
    ``with_range`` and both sides have paired repeats; '-' when either side has no figure."""
    if not (a.get(key) and b.get(key)):
        return "-"
    text = f"{a[key] / b[key]:.2f}x"
    spread = paired_ratio_range(a, b, key) if with_range else None
    return f"{text} {spread[0]:.2f}-{spread[1]:.2f}" if spread else text


def measure(
    root: Path,
    shape: str,
    impls: set[str],
    steps: int,
    anchors: Path | None,
    repeat: int = 1,
    progress=None,
    settings: tuple[str, ...] = tuple(SETTINGS),
    kit_overrides: dict | None = None,
) -> list[dict]:
    """Each setting of one shape. The kit and Unsloth run ``repeat`` times, alternating (every kit setting,
    then one Unsloth invocation, which covers all three settings), so host-speed drift hits both alike;
    ref, hf and liger run once, in the first repeat. ``progress(cells)`` gets the cells so far after each
    setting and repeat (main saves them: a call cut off by its time limit keeps the rows it finished).
    ``kit_overrides`` (``section.key``: value) go into every kit run's config (ours, nographs)."""
    kit = dict(kit_overrides or {})
    name, config = SHAPES[shape]
    model = model_dir(root / "models", name, config, weights=True)
    cells = {setting: {"shape": shape, "setting": setting} for setting in settings}
    ours: dict[str, list[dict]] = {setting: [] for setting in settings}
    nographs: dict[str, list[dict]] = {setting: [] for setting in settings}
    unsloth: dict[str, list[dict]] = {setting: [] for setting in settings}
    for i in range(repeat):
        tag = "" if i == 0 else f" r{i + 1}"
        for setting in settings:
            (method, gc), cell = SETTINGS[setting], cells[setting]
            if "ours" in impls:
                run = run_ours(root, f"{shape} {setting}{tag}", model, method, steps, gc, ALL_LINEAR, **kit)
                ours[setting].append(run)
            if "nographs" in impls:  # the kit with its layers eager: what the CUDA graphs buy, same call
                nographs[setting].append(
                    run_ours(
                        root,
                        f"{shape} {setting} nographs{tag}",
                        model,
                        method,
                        steps,
                        gc,
                        ALL_LINEAR,
                        **{**kit, "performance.cuda_graphs": "off"},
                    )  # fmt: skip
                )
            if i > 0:
                continue
            if "ref" in impls:
                cell["ref"] = run_ours(
                    root, f"{shape} {setting} ref", model, method, steps, gc, ALL_LINEAR, fast_path="off"
                )
            for impl, liger in (("hf", False), ("liger", True)):
                if impl in impls:
                    cell[impl] = run_hf(model, steps, method == "qlora", gc, liger)
            if progress is not None:  # a call cut off during Unsloth's run keeps the rows before it
                progress(
                    [
                        {**c, **({"ours": aggregate_runs(ours[s])} if ours[s] else {})}
                        for s, c in cells.items()
                    ]
                )
        if "unsloth" in impls and anchors is not None:
            rows = run_unsloth(anchors, steps, None if shape == "llama" else model, settings)
            for setting in settings:
                unsloth[setting].append(rows.get(setting, {"error": "no result"}))
        for setting, cell in cells.items():
            for impl, runs in (
                ("ours", ours[setting]),
                ("nographs", nographs[setting]),
                ("unsloth", unsloth[setting]),
            ):
                if runs:
                    cell[impl] = aggregate_runs(runs)
        if progress is not None:
            progress(list(cells.values()))
    return list(cells.values())


def measure_glm(root: Path, impls: set[str], steps: int) -> dict:
    """Scaled-down glm4_moe, QLoRA + checkpointing on the attention projections: the kit (fast and
    reference path) against Trainer + PEFT with the same targets (Liger and Unsloth have no glm4_moe row)."""
    glm = model_dir(root / "models", "glm4-moe-small", GLM_SMALL)
    cell = {"shape": "glm", "setting": "qlora+gc"}
    if "ours" in impls:
        cell["ours"] = run_ours(root, "glm qlora+gc", glm, "qlora", steps, True, ATTENTION)
    if "ref" in impls:
        cell["ref"] = run_ours(
            root, "glm qlora+gc ref", glm, "qlora", steps, True, ATTENTION, fast_path="off"
        )
    if "hf" in impls:
        cell["hf"] = run_hf(glm, steps, True, True, False, targets=ATTENTION)
    return cell


IMPLS = ["ours", "nographs", "ref", "hf", "liger", "unsloth"]


def table_lines(rows: list[dict]) -> list[str]:
    """The printed table: tokens/s | peak GiB per implementation, then ratios of the kit to the others.
    With repeats, ours/unsloth also shows the min-max of the per-repeat (paired) ratio."""
    spread = any(paired_ratio_range(c.get("ours") or {}, c.get("unsloth") or {}) for c in rows)
    width = 20 if spread else 14
    head = f"{'shape':<7}{'setting':<10}" + "".join(f"{i + ' tok/s | GiB':>24}" for i in IMPLS)
    lines = [
        head + f"{'ours/unsloth':>{width}}{'ours/liger':>12}{'ours/hf':>9}{'mem/unsloth':>13}{'graphs':>8}"
    ]
    for cell in rows:
        line = f"{cell['shape']:<7}{cell['setting']:<10}"
        for impl in IMPLS:
            r = cell.get(impl)
            if not r:
                line += f"{'':>24}"
            elif "error" in r:
                line += f"{'ERROR':>24}"
            else:
                line += f"{r['tokens_per_sec']:>14,.0f} | {r['peak_gib']:>5.2f}".rjust(24)
        ours, liger, hf, unsloth = (cell.get(k) or {} for k in ("ours", "liger", "hf", "unsloth"))
        line += f"{format_ratio(ours, unsloth, with_range=True):>{width}}{format_ratio(ours, liger):>12}"
        line += f"{format_ratio(ours, hf):>9}{format_ratio(ours, unsloth, 'peak_gib'):>13}"
        line += f"{format_ratio(ours, cell.get('nographs') or {}):>8}"
        lines.append(line)
    if spread:
        lines.append(
            "ours/unsloth: ratio of median tokens/s, then min-max of repeat i of ours over repeat i of unsloth"
        )
    for cell in rows:
        for impl in ("ours", "nographs"):
            for run in (cell.get(impl) or {}).get("runs") or [cell.get(impl) or {}]:
                if (
                    run.get("cuda_graphs") in ("layers", "layer stack")
                    and run.get("graphs_replayed") is False
                ):
                    why = run.get("graphs_off") or "no capture"
                    lines.append(
                        f"NOTE {cell['shape']} {cell['setting']} {impl}: CUDA graphs planned, never replayed ({why})"
                    )
    for cell in rows:
        for impl in IMPLS:
            r = cell.get(impl) or {}
            for error in r.get("errors") or ([r["error"]] if "error" in r else []):
                lines.append(f"ERROR {cell['shape']} {cell['setting']} {impl}: {error[-600:]}")
    return lines


def quantization_note(cell: dict) -> str | None:
    """Where Trainer + PEFT left fused expert weights out of 4-bit (glm4_moe): how much of each row is 4-bit."""
    hf = cell.get("hf") or {}
    if not hf.get("unquantized_expert_bytes"):
        return None
    shares = [
        f"{impl} {r['quantized_params'] / 1e6:,.0f}M of {r['total_params'] / 1e6:,.0f}M params in 4-bit"
        for impl, r in (("ours", cell.get("ours") or {}), ("hf", hf))
        if r.get("quantized_params") is not None and r.get("total_params")
    ]
    grouped = (cell.get("ours") or {}).get("moe_experts_grouped")
    if grouped is not None:
        shares.append(f"ours: {grouped} experts modules on grouped GEMMs")
    return f"NOTE {cell['shape']} {cell['setting']}: " + "; ".join(shares + [f"hf: {hf.get('note', '')}"])


def print_table(rows: list[dict]) -> None:
    print("\n".join(table_lines(rows)), flush=True)
    for note in filter(None, map(quantization_note, rows)):
        print(note, flush=True)


def loss_check(root: Path, steps: int, setting: str = "lora+gc") -> dict:
    """Per-step loss of the fast path against the reference path over ``steps`` steps (same data, seed), and
    against the same fast path with its CUDA graphs off (replays must train as the eager layers do) and, with
    checkpointing, with the layer inputs kept on the device (``memory.offload_checkpoints: false``: plain
    checkpointing, no graphs), which tells a fault in the offload from bf16 divergence. QLoRA adds the
    reference with its norms, embeddings and head kept in bf16 (``quantization.upcast: off``), the fast path's
    precision: the plain reference upcasts them to fp32 and parts from every fast variant at step 2 (session 29)."""
    method, checkpointing = SETTINGS[setting]
    model = model_dir(root / "models", *SHAPES["llama"], weights=True)
    quiet = {"eval.interval": 10_000}
    variants = {"fast": {}, "eager": {"performance.cuda_graphs": "off"}}
    if checkpointing:
        variants["plain"] = {"memory.offload_checkpoints": False}
    runs = {
        name: run_ours(
            root, f"loss {name}", model, method, steps, checkpointing, ALL_LINEAR, **quiet, **extra
        )
        for name, extra in variants.items()
    }
    runs["ref"] = run_ours(root, "loss ref", model, method, steps, checkpointing, ALL_LINEAR, fast_path="off")
    if method == "qlora":
        # The reference upcasts norms, embeddings and head to fp32; this one keeps them bf16.
        extra = {"fast_path": "off", "quantization.upcast": "off"}
        runs["ref16"] = run_ours(root, "loss ref16", model, method, steps, checkpointing, ALL_LINEAR, **extra)
    failed = [run.get("error") for run in runs.values() if "error" in run]
    if failed:
        return {"setting": setting, "error": failed[0]}
    fast, ref = runs["fast"], runs["ref"]

    def max_diff(a: str, b: str) -> float:
        return round(max(abs(x - y) for x, y in zip(runs[a]["losses"], runs[b]["losses"])), 6)

    diffs = [abs(a - b) for a, b in zip(fast["losses"], ref["losses"])]
    result = {
        "setting": setting,
        "steps": len(diffs),
        "max_abs_diff": round(max(diffs), 5),
        "mean_abs_diff": round(sum(diffs) / len(diffs), 5),
        "graphs_vs_eager_max_abs_diff": max_diff("fast", "eager"),
        "eager_vs_ref_max_abs_diff": max_diff("eager", "ref"),
        "graphs_replayed": fast["graphs_replayed"],
        "first": (fast["losses"][0], ref["losses"][0]),
        "last": (fast["losses"][-1], ref["losses"][-1]),
        "fast_path": fast["fast_path"],
    }
    if "ref16" in runs:
        result["fast_vs_ref16_max_abs_diff"] = max_diff("fast", "ref16")
        result["ref16_vs_ref_max_abs_diff"] = max_diff("ref16", "ref")
    if "plain" in runs:
        result["plain_vs_ref_max_abs_diff"] = max_diff("plain", "ref")
        result["plain_vs_eager_max_abs_diff"] = max_diff("plain", "eager")
    return {**result, **{f"{name}_losses": run["losses"] for name, run in runs.items()}}


def max_loss_diff(a: dict[int, float], b: dict[int, float], steps: range) -> tuple[int, float | None]:
    """(steps compared, max |a - b|) over the steps of ``steps`` that both runs logged."""
    diffs = [abs(a[s] - b[s]) for s in steps if s in a and s in b]
    return len(diffs), (max(diffs) if diffs else None)


def losses_by_step(run: Path) -> dict[int, float]:
    """Step -> loss of a run folder; a step replayed after a resume counts once, its last record."""
    from trainer.runfolder import iter_records, last_per_step

    return {
        r["step"]: r["loss"] for r in last_per_step(list(iter_records(run / "logs" / "training_log.jsonl")))
    }


def kill_and_resume(root: Path, name: str, config: Path, kill_after: int, optimizer: str) -> dict:
    """Train, SIGKILL once checkpoint-``kill_after`` exists, check its optimizer state, run the same command
    again (which resumes from it). Returns the run folder's per-step losses and what happened."""
    out = root / name
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    with (root / f"{name}.first.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 900
        while (
            proc.poll() is None and not (out / f"checkpoint-{kill_after}").exists() and time.time() < deadline
        ):
            time.sleep(0.05)
        finished_first = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if not (out / f"checkpoint-{kill_after}").exists():
        return {"error": f"no checkpoint-{kill_after}: " + (root / f"{name}.first.log").read_text()[-1500:]}
    report = {
        "killed_after_step": max(losses_by_step(out), default=0),
        "first_run_finished_before_kill": finished_first,
        "optimizer_state": checkpoint_optimizer_check(out / f"checkpoint-{kill_after}", optimizer),
    }
    resumed = harness.run_child(cmd, 900, cwd=REPO)
    if resumed.returncode == harness.TIMED_OUT:
        return {**report, "error": "resumed run timed out"}
    if resumed.returncode != 0:
        return {**report, "error": harness.output_tail(resumed, 1500)}
    from trainer.runfolder import iter_records

    events = list(iter_records(out / "logs" / "events.jsonl"))
    report["resumed_from_step"] = next((e.get("step") for e in events if e["event"] == "resume"), None)
    return {**report, "losses": losses_by_step(out)}


def resume_check(
    root: Path,
    steps: int = 20,
    kill_after: int = 10,
    optimizer: str = "adamw",
    noise_floor: bool = False,
    model: Path | None = None,
    extra: dict | None = None,
) -> dict:
    """Resume is exact up to GPU noise: one uninterrupted run, one SIGKILLed once checkpoint-``kill_after``
    exists and re-run, losses of steps after the kill compared. ``noise_floor``: a second uninterrupted run
    gives the run-to-run difference of bf16 kernels (not bitwise reproducible) to read the first against.
    Every run saves at ``kill_after``, so all do the same work. ``model`` (default: the Llama-1B shape, whose
    LoRA tensors are large enough for bitsandbytes' 8-bit state) and ``extra`` (section.key overrides)
    let a CPU test run the same code on a tiny model."""
    model = model or model_dir(root / "models", *SHAPES["llama"], weights=True)
    tag = "resume" if optimizer == "adamw" else f"optim_{optimizer}"
    extra = {**(extra or {}), "training.save_steps": kill_after, "optimization.optimizer": optimizer}
    result: dict = {"optimizer": optimizer, "steps": steps, "kill_after": kill_after}
    straight = run_ours(root, f"{tag} straight", model, "lora", steps, True, ALL_LINEAR, **extra)
    if "error" in straight:
        return {**result, "error": straight["error"]}
    result.update(tokens_per_sec=straight["tokens_per_sec"], peak_gib=straight["peak_gib"])
    base = losses_by_step(Path(straight["run_dir"]))
    after = range(kill_after + 1, steps + 1)
    if noise_floor:
        again = run_ours(root, f"{tag} straight again", model, "lora", steps, True, ALL_LINEAR, **extra)
        if "error" in again:
            return {**result, "error": again["error"]}
        result["noise_floor"] = max_loss_diff(base, losses_by_step(Path(again["run_dir"])), after)[1]
    config = trainer_config(root / f"{tag}_killed", model, "lora", steps, True, ALL_LINEAR, **extra)
    shutil.rmtree(root / f"{tag}_killed", ignore_errors=True)
    killed = kill_and_resume(root, f"{tag}_killed", config, kill_after, optimizer)
    losses = killed.pop("losses", {})
    compared, worst = max_loss_diff(base, losses, after)
    return {**result, "compared_steps": compared, "max_abs_diff": worst, **killed}


def save_results(root: Path, results: dict) -> None:
    """Written after every row and check, so a call cut off by its time limit still returns what it measured."""
    harness.write_json(root / "bench_core_gpu.json", results)
    if os.environ.get("OUT"):
        try:  # a run left going in the background outlives its call's $OUT; the copy under --out stays
            shutil.copy(root / "bench_core_gpu.json", Path(os.environ["OUT"]) / "bench_core_gpu.json")
        except OSError:
            pass


def comma_list(allowed: tuple[str, ...], what: str, empty_ok: bool = False):
    """An argparse type: a comma-separated list of ``allowed`` names, refused with the one that is not;
    ``empty_ok``: "" is no names (``--only ""`` runs only the loss, resume or optimizer checks)."""

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        wrong = [n for n in names if n not in allowed]
        if wrong or not (names or empty_ok):
            raise argparse.ArgumentTypeError(
                f"{what} '{(wrong or [text])[0]}': expected {', '.join(allowed)}"
            )
        return names

    return parse


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': expected a whole number of at least 1")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default="/tmp/bench-core")
    parser.add_argument(
        "--only",
        default="llama",
        type=comma_list((*SHAPES, "glm"), "shape", empty_ok=True),
        help='llama, qwen3, glm ("": none, for --loss-steps / --resume-check alone)',
    )
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        type=comma_list(tuple(SETTINGS), "setting"),
        help="llama/qwen3",
    )
    parser.add_argument("--impl", default="ours,ref,hf,liger,unsloth", type=comma_list(tuple(IMPLS), "impl"))
    parser.add_argument("--anchors", type=Path, help="folder with unsloth_bench.py (../shared/anchors)")
    parser.add_argument(
        "--repeat",
        type=positive,
        default=1,
        help="llama/qwen3: run ours and unsloth N times, alternating; medians and the paired-ratio range",
    )
    parser.add_argument(
        "--loss-steps", type=int, default=0, help="compare per-step losses, fast vs reference"
    )
    parser.add_argument(
        "--loss-setting", default="lora+gc", choices=tuple(SETTINGS), help="the setting --loss-steps trains"
    )
    parser.add_argument(
        "--profile-from",
        type=int,
        default=0,
        help="kit runs profile two steps from this one (performance.profile_from): <run>/profile/",
    )
    parser.add_argument("--resume-check", action="store_true")
    parser.add_argument(
        "--optimizer-check",
        type=comma_list(OPTIMIZERS, "optimizer"),
        default=[],
        help="comma list of optimization.optimizer values: for each, 20 steps straight twice (the noise "
        "floor) and once SIGKILLed after checkpoint-10 and resumed; losses, speed, optimizer state",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    impls = set(args.impl)
    results: dict = {"rows": [], "repeat": args.repeat}
    for shape in args.only:
        if shape == "glm":
            results["rows"].append(measure_glm(root, impls, args.steps))
        else:  # after each repeat, the rows so far: results["rows"] grows only when measure returns
            progress = lambda cells: save_results(root, {**results, "rows": results["rows"] + cells})  # noqa: E731
            kit = {"performance.profile_from": args.profile_from} if args.profile_from else {}
            results["rows"] += measure(
                root, shape, impls, args.steps, args.anchors, args.repeat, progress, tuple(args.settings), kit
            )
        save_results(root, results)
    if results["rows"]:
        print_table(results["rows"])
    if args.loss_steps:
        results["loss_check"] = loss_check(root, args.loss_steps, args.loss_setting)
        print(
            "LOSS", json.dumps({k: v for k, v in results["loss_check"].items() if not k.endswith("losses")})
        )
        save_results(root, results)
    if args.resume_check:
        results["resume_check"] = resume_check(root)
        print("RESUME", json.dumps(results["resume_check"]), flush=True)
        save_results(root, results)
    for optimizer in args.optimizer_check:
        check = resume_check(root, optimizer=optimizer, noise_floor=True)
        results.setdefault("optimizer_check", []).append(check)
        print("OPTIM", json.dumps(check), flush=True)
        save_results(root, results)
    save_results(root, results)


if __name__ == "__main__":
    main()
