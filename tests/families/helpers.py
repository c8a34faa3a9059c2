"""Shared by the GLA and Mamba family tests: tiny configs, runs through the CLI, exact-resume checks."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import torch
import yaml

from tests.helpers import REPO, start_trainer, wait_for
from trainer import runfolder
from trainer.config import load_config
from trainer.runfolder import iter_records, last_per_step


def small_corpus(folder) -> str:
    """The first 240 documents of the shipped corpus: tokenizing all of it would dominate these runs."""
    path = folder / "corpus.jsonl"
    if not path.exists():
        lines = (REPO / "data" / "tiny_corpus.jsonl").read_text().splitlines(keepends=True)[:240]
        path.write_text("".join(lines))
    return str(path)


def family_config(folder, model: str, targets: list[str], extra: dict | None = None, output: str = "run"):
    """A run of a few seconds: 8 steps of 2 x 2 rows of 48 tokens, a checkpoint every 4 steps."""
    cfg = {
        "paths": {"train_file": small_corpus(folder), "output_dir": str(folder / output)},
        "model": {"name_or_path": str(REPO / "configs" / model), "random_init": True},
        "training": {
            "method": "lora",
            "max_steps": 8,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "save_steps": 4,
        },
        "optimization": {"learning_rate": 1e-2, "warmup_steps": 1},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": targets},
        "data": {"max_length": 48, "val_fraction": 0.05},
        "eval": {"interval": 4, "batch_size": 4, "max_batches": 1},
        "logging": {"progress_bar": False, "telemetry_interval": 0.5},
    }
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    path = folder / f"{output}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(run) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in last_per_step(list(iter_records(run / "logs" / runfolder.TRAINING_LOG)))
    }


def events(run, name: str) -> list[dict]:
    return [e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == name]


def cli(*args: str) -> int:
    """The real CLI (``python -m trainer ...``) in this process: no interpreter start-up per run."""
    from trainer.cli import main

    return main(list(args))


def train_killed_and_resumed(config, run, capsys) -> str:
    """Start a run in a subprocess, SIGKILL it once checkpoint-4 is complete, then resume it to the end
    through the CLI in this process; returns what the resume printed."""
    proc = start_trainer("train", "--config", str(config))
    assert wait_for(lambda: (run / "checkpoint-4" / "trainer_state.json").exists() or proc.poll() is not None)
    proc.send_signal(signal.SIGKILL)
    output, _ = proc.communicate()
    assert (run / "checkpoint-4").is_dir(), output[-3000:]
    capsys.readouterr()
    assert cli("train", "--config", str(config)) == 0
    stdout = capsys.readouterr().out
    assert "resuming from" in stdout
    return stdout


def assert_resumed_exactly(run, reference: dict[int, float]) -> None:
    resumed = losses(run)
    assert sorted(resumed) == sorted(reference) == list(range(1, 9))
    for step, loss in reference.items():
        assert abs(resumed[step] - loss) < 1e-6, (step, resumed[step], loss)
    assert len(events(run, "resume")) == 1
    assert json.loads((run / runfolder.RUN_JSON).read_text())["status"] == "finished"


def train_in_process(config_path) -> dict[int, float]:
    """``python -m trainer train --config ...`` in this process; returns the logged losses."""
    assert cli("train", "--config", str(config_path)) == 0
    return losses(Path(yaml.safe_load(Path(config_path).read_text())["paths"]["output_dir"]))


def adapter_tensors(run, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / f"final-checkpoint-{step}" / "adapter_model.safetensors"))


def adapter_config(run, step: int) -> dict:
    return json.loads((run / f"final-checkpoint-{step}" / "adapter_config.json").read_text())


class CpuAccelerator:
    """What forward_loss needs from accelerate, without creating a process group."""

    device = torch.device("cpu")

    @staticmethod
    def autocast():
        return contextlib.nullcontext()


def lora_gradients(model, batch) -> dict[str, torch.Tensor]:
    from trainer.training.step import forward_loss

    model.zero_grad(set_to_none=True)
    ce_sum, _ = forward_loss(model, batch, CpuAccelerator())
    ce_sum.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def error_line(stderr: str) -> str:
    """The CLI's one-line error (libraries may add warnings around it)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


VARIANTS = [
    ("lora", "default"),
    ("dora", "default"),
    ("rslora", "default"),
    ("lora", "gaussian"),
    ("lora", "pissa"),
    ("lora", "pissa_niter_2"),
]


def random_batch(packing: bool, width: int = 32, seed: int = 0) -> dict:
    """Documents of random tokens: packed into full rows, or one per row with padding (packing off)."""
    from trainer.data.dataset import Sequence, collate, pack

    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(4, 1000, (n,), generator=gen).tolist() for n in (13, 27, 9, 20)]
    if packing:
        rows = pack([(d, d) for d in docs], width, 0)
    else:
        rows = [Sequence(d, d, list(range(len(d)))) for d in docs]
    return collate(rows, 0)


def train_steps(model, batch: dict, steps: int = 3, lr: float = 1e-2) -> list[float]:
    """A few AdamW steps on one batch (what the loop does, minus logging): the losses before each."""
    from trainer.training.step import count_targets, forward_loss

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    seen = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        ce_sum, _ = forward_loss(model, batch, CpuAccelerator())
        (ce_sum / count_targets(batch)).backward()
        optimizer.step()
        seen.append(float(ce_sum.detach()) / count_targets(batch))
    return seen


def check_example_yaml_runs(tmp_path, name: str) -> None:
    """configs/<name>.yaml trains two steps from the repository root, as the README runs it."""
    from trainer.training.loop import train

    overrides = [
        f"paths.output_dir={tmp_path / 'run'}",
        f"paths.train_file={small_corpus(tmp_path)}",
        "training.max_steps=2",
        "data.max_length=32",
        "eval.at_end=false",
        "logging.progress_bar=false",
    ]
    assert train(load_config(REPO / "configs" / f"{name}.yaml", overrides)) == 0
    assert sorted(losses(tmp_path / "run")) == [1, 2]


def check_qlora_gradients(model, batch: dict, expected_tensors: int, every_one_nonzero: bool = True) -> None:
    """A QLoRA model's LoRA gradients are non-zero, unchanged by an evaluation-style pass first (the
    platform notes' trap: a no-grad forward must not alter 4-bit state), and a few steps lower the loss."""
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would leave A without gradient
            torch.nn.init.normal_(param, std=0.02)
    before = lora_gradients(model, batch)
    with torch.no_grad():
        model(input_ids=batch["input_ids"][:, :16])
    after = lora_gradients(model, batch)
    assert before.keys() == after.keys() and len(before) == expected_tensors
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-7)
    nonzero = [g.abs().sum() > 0 for g in before.values()]
    assert all(nonzero) if every_one_nonzero else any(nonzero)
    seen = train_steps(model, batch)
    assert seen[-1] < seen[0] - 0.01, seen


def check_variant_trains(folder, model_name: str, targets: list[str], variant: str, init: str, method="lora"):
    """load_for_training with this variant, then a few steps: the adapter is the variant asked for, and learns."""
    from trainer.model.loading import load_for_training

    extra = {"training": {"method": method}, "lora": {"variant": variant, "init": init, "dropout": 0.0}}
    cfg = load_config(family_config(folder, model_name, targets, extra, output=f"{variant}-{init}"))
    loaded = load_for_training(cfg, torch.device("cpu"))
    peft_config = loaded.model.peft_config["default"]
    assert peft_config.use_dora is (variant == "dora") and peft_config.use_rslora is (variant == "rslora")
    assert peft_config.init_lora_weights == (True if init == "default" else init)
    names = [n for n, p in loaded.model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names) is (variant == "dora")
    seen = train_steps(loaded.model, random_batch(loaded.family.packing))
    assert seen[-1] < seen[0] - 0.01, seen
    return loaded
