"""Baseline for bench_core_gpu.py: transformers' Trainer + PEFT on the same model, rows and settings.

Prints one JSON line: median tokens/s after 5 warm-up steps, peak GiB, and how much of the model is 4-bit
(bitsandbytes replaces ``nn.Linear`` modules only: fused 3-D MoE expert parameters, as glm4_moe's are in
transformers 5, stay 16-bit, and ``prepare_model_for_kbit_training`` then upcasts them to fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402


def load_model(path: str, qlora: bool, device_map: dict):
    """The model as a Trainer user loads it: bf16, or NF4 with double quantization through bitsandbytes."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    kwargs = {"dtype": torch.bfloat16, "device_map": device_map}
    if qlora:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    if (Path(path) / "model.safetensors").exists():  # weights saved once by bench_core_gpu.py
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:  # random init; bitsandbytes quantizes while loading weights
        config = AutoConfig.from_pretrained(path)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, **kwargs)


def build_model(path: str, qlora: bool, checkpointing: bool, targets: list[str], device_map: dict):
    """LoRA r16 alpha 32 on ``targets``, after PEFT's usual k-bit preparation for QLoRA."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = load_model(path, qlora, device_map)
    if qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    return get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"),
    )


def quantization_report(model, qlora: bool) -> dict:
    """Parameter counts as the kit's model_report gives them (a 4-bit weight counted unpacked, two values a
    byte), and a note when fused expert weights escaped 4-bit: the Trainer row then holds them in fp32 where
    the kit's holds them in 4-bit. Counted here, not through the kit's code, so this process stays plain
    transformers + PEFT."""
    four_bit = ()
    if qlora:
        import bitsandbytes as bnb

        four_bit = bnb.nn.Params4bit
    report = dict.fromkeys(("total_params", "trainable_params", "quantized_params"), 0)
    report.update(unquantized_bytes=0, unquantized_expert_bytes=0)
    for name, param in model.named_parameters():
        quantized = bool(four_bit) and isinstance(param, four_bit)
        count = param.numel() * (2 if quantized else 1)
        report["total_params"] += count
        report["trainable_params"] += count if param.requires_grad else 0
        if quantized:
            report["quantized_params"] += count
            continue
        report["unquantized_bytes"] += param.numel() * param.element_size()
        if param.dim() == 3 and "expert" in name:
            report["unquantized_expert_bytes"] += param.numel() * param.element_size()
    if qlora and report["unquantized_expert_bytes"]:
        report["note"] = (
            f"{report['unquantized_expert_bytes'] / 2**30:.2f} GiB of fused MoE expert weights are not 4-bit "
            "(bitsandbytes replaces nn.Linear only; prepare_model_for_kbit_training upcast them to fp32)"
        )
    return report


def target_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"'{text}': expected a comma list of module names, e.g. q_proj,v_proj"
        )
    return names


def main() -> None:
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from trainer.config import DataConfig, PathsConfig
    from trainer.data.dataset import prepare_data

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--qlora", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--liger", action="store_true", help="use_liger_kernel=True (Trainer + Liger)")
    parser.add_argument("--train-file", default=str(REPO / "data" / "tiny_corpus.jsonl"))
    parser.add_argument(
        "--targets",
        type=target_list,
        default=harness.ALL_LINEAR,
        help="LoRA target modules, comma list (all seven)",
    )
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    paths = PathsConfig(train_file=args.train_file)
    rows = prepare_data(paths, DataConfig(max_length=2048, val_fraction=0.0), tokenizer, True).train
    dataset = [{"input_ids": r.input_ids, "labels": r.labels, "position_ids": r.position_ids} for r in rows]

    model = build_model(args.model, args.qlora, args.checkpointing, args.targets, {"": 0})
    report = quantization_report(model, args.qlora)

    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t0)

    def collate(batch):  # rows are numpy arrays of one length (packed to max_length)
        return {k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in batch[0]}

    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        max_steps=args.steps,
        learning_rate=2e-4,
        bf16=True,
        gradient_checkpointing=args.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        lr_scheduler_type="constant",
        dataloader_drop_last=True,
        use_liger_kernel=args.liger,
    )
    torch.cuda.reset_peak_memory_stats()
    Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[Timer()]
    ).train()
    tokens_per_step = 4 * 2048
    median = statistics.median(step_times[5:] or step_times)
    print(
        json.dumps(
            {
                "steps": len(step_times),
                "tokens_per_sec": round(tokens_per_step / median, 1),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "targets": args.targets,
                **report,
            }
        )
    )


if __name__ == "__main__":
    main()
