"""Baseline for bench_core_gpu.py: transformers' Trainer + PEFT on the same model, rows and settings.

Prints one JSON line: median tokens/s after 5 warm-up steps, and peak GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from trainer.config import DataConfig, PathsConfig
    from trainer.data.dataset import prepare_data

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--qlora", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--liger", action="store_true", help="use_liger_kernel=True (Trainer + Liger)")
    parser.add_argument("--train-file", default=str(REPO / "data" / "tiny_corpus.jsonl"))
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    paths = PathsConfig(train_file=args.train_file)
    rows = prepare_data(paths, DataConfig(max_length=2048, val_fraction=0.0), tokenizer, True).train
    dataset = [{"input_ids": r.input_ids, "labels": r.labels, "position_ids": r.position_ids} for r in rows]

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.model)
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": 0}}
    if args.qlora:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    if (Path(args.model) / "model.safetensors").exists():  # weights saved once by bench_core_gpu.py
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
    if args.qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"),
    )

    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t0)

    def collate(batch):
        return {k: torch.tensor([b[k] for b in batch]) for k in batch[0]}

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
            }
        )
    )


if __name__ == "__main__":
    main()
