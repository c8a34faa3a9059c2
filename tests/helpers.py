"""Test helpers: the tiny config, a subprocess runner for the trainer, polling."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A run small enough for a few seconds on 2 CPU cores, still exercising MoE routing, eval and checkpoints.
TINY = {
    "paths": {"train_file": str(REPO / "data" / "tiny_corpus.jsonl")},
    "model": {"name_or_path": str(REPO / "configs" / "tiny-moe"), "random_init": True},
    "training": {
        "method": "lora",
        "max_steps": 12,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "save_steps": 4,
        "keep_top_k": 2,
    },
    "optimization": {"learning_rate": 3e-3, "lr_scheduler": "cosine", "warmup_steps": 2},
    "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "lm_head"]},
    "data": {"max_length": 64, "val_fraction": 0.02},
    "eval": {"interval": 4, "batch_size": 8, "max_batches": 2},
    "logging": {"interval": 1, "expert_interval": 4, "telemetry_interval": 0.5, "progress_bar": False},
}


def deep_merge(base: dict, extra: dict) -> dict:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        merged.setdefault(section, {}).update(values)
    return merged


def trainer_env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_trainer(*args: str, timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=cwd,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_trainer(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=cwd,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, timeout: float = 300, interval: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def measured(fn, *args):
    """``fn(*args)``, its wall time and the peak of memory allocated meanwhile (tracemalloc)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = fn(*args)
        return result, time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
