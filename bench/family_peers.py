"""bench/bench_families.py's peer rows: transformers' Trainer + PEFT on the same model folder and kernels
(issue 30)."""

from __future__ import annotations

import time
from pathlib import Path


def trainer_row(folder: Path, row, seq: int, steps: int, device) -> dict:
    """Transformers' Trainer + PEFT LoRA (r16, alpha 32, the kit row's targets) for ``row`` (a bench_families
    ``Row``) on the same random-init model, with the kernels the kit's row runs: fla's model (GLA), and for
    Mamba the path the family picks, bound process-wide before the model is built. bf16 autocast over bf16
    weights (``bf16=True``), as the kit's rows. Tokens/s over the timed steps' own time (the callbacks exclude
    data loading: in the peer's favour)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from trainer.families import mamba

    kind = row.model["model_type"]
    cuda = device.type == "cuda"
    path, model_class = "fla-triton", AutoModelForCausalLM
    if kind == "gla":
        import fla  # noqa: F401 - registers the gla classes

        from trainer.families import fla_tuning

        fla_tuning.use_tuned_configs()  # the kit's shipped Triton configs, as the kit's own row has them
        targets = "all-linear"
    else:  # transformers' own classes: `import fla` points the Auto classes at fla's Mamba models
        config_class, model_class = mamba._transformers_classes(kind)
        config = config_class.from_pretrained(folder)
        path = mamba.auto_kernel_path(config)
        mamba.use_kernel_path(kind, path)
        targets = mamba.default_lora_targets(config)
    torch.manual_seed(0)
    model = model_class.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    model = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"),
    )
    gen = torch.Generator().manual_seed(0)
    vocab = row.model["vocab_size"]
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(3, vocab, (row.batch, seq), generator=gen)
    ]
    warmup, times, losses = min(3, steps), [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.started)
            if len(times) == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=str(folder / "trainer-out"), per_device_train_batch_size=row.batch, max_steps=warmup + steps,
        learning_rate=1e-4, bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to=[],
        lr_scheduler_type="constant", dataloader_drop_last=True, gradient_checkpointing=row.checkpointing,
    )  # fmt: skip
    cycled = data * (warmup + steps)  # one random batch every step, as the kit's rows
    Trainer(model=model, args=args, train_dataset=cycled, callbacks=[Timer()]).train()
    timed = sum(times[warmup:])
    return dict(
        status="ok",
        kernel_path=f"{path} (Trainer)",
        total_params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        trainable_params_m=round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2),
        tokens_per_s=round(row.batch * seq * (len(times) - warmup) / timed, 1),
        step_s=round(timed / max(1, len(times) - warmup), 4),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        first_loss=round(losses[0], 4) if losses else None,
        last_loss=round(losses[-1], 4) if losses else None,
        check=None,
    )
