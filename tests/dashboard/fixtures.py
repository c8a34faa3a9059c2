"""Hand-made run folders for the dashboard tests, written with the trainer's own ``runfolder`` helpers.

``build_log_root`` lays out a log root with one run per oddity the dashboard must survive:
a resume that replays steps, a NaN loss, a garbage line, a half-written last line, an error with
a traceback, GPU samples for two devices plus the CPU, expert usage, pruned checkpoints, empty
and missing logs, a broken run.json, a nested run, and a symlink that leaves the root.
The ``log_root``, ``app`` and ``client`` fixtures built on them are in tests/dashboard/conftest.py.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from trainer import runfolder

DEMO = "demo"
TOTAL_STEPS = 60
RESUME_STEP = 20  # the demo run crashed after step 25 and resumed from checkpoint-20
LAST_STEP = 40
NAN_STEP = 33
EXPERTS = 4
LAYERS = 2


def write_run_json(run: Path, payload: dict) -> None:
    run.mkdir(parents=True, exist_ok=True)
    runfolder.write_json_atomic(run / runfolder.RUN_JSON, payload)


def append(path: Path, records: list[dict], raw_tail: bytes = b"") -> None:
    """Append records as the trainer does (``encode_record``), then optional raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:
        for record in records:
            handle.write(runfolder.encode_record(record).encode())
        handle.write(raw_tail)


def train_record(step: int, ts: float, loss: float, total: int = TOTAL_STEPS) -> dict:
    return {
        "ts": ts,
        "step": step,
        "total_steps": total,
        "epoch": step / 30,
        "loss": loss,
        "lr": 1e-4 * (1 - step / total),
        "grad_norm": 0.5 + 0.01 * step,
        "tokens": 512,
        "tokens_per_sec": 1000.0 + step,
        "steps_per_sec": 2.0,
        "eta_seconds": float(total - step),
        "elapsed": float(step),
        "peak_mem_mb": 900.0 + step,
    }


def demo_loss(step: int, replay: bool = False) -> float:
    if step == NAN_STEP:
        return math.nan
    return 3.0 / (1 + 0.1 * step) + (0.05 if replay else 0.0)


def write_checkpoint(run: Path, step: int, metric_value: float) -> None:
    folder = run / f"{runfolder.CHECKPOINT_PREFIX}{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    (folder / runfolder.TRAINER_STATE).write_text(
        json.dumps(
            {"step": step, "epoch": step / 30, "metric": "eval_loss", "metric_value": metric_value, "ts": 0}
        )
    )


def build_demo(run: Path, now: float) -> None:
    """A running run: 25 steps, crash, resume from step 20, replay 21-25, run on to step 40."""
    t0 = now - 60
    logs = run / runfolder.LOGS_DIR
    write_run_json(
        run,
        {
            "run_id": "demo-1",
            "started_at": t0,
            "updated_at": t0 + 30,
            "ended_at": None,
            "status": "running",
            "model": "tiny-moe",
            "family": "causal",
            "method": "lora",
            "world_size": 1,
            "total_steps": TOTAL_STEPS,
            "step": LAST_STEP,
            "resumes": 1,
        },
    )
    first = [train_record(s, t0 + s, demo_loss(s)) for s in range(1, 26)]
    second = [train_record(s, t0 + 10 + s, demo_loss(s, replay=True)) for s in range(21, LAST_STEP + 1)]
    second[-1]["ts"] = now - 1.0
    append(logs / runfolder.TRAINING_LOG, first, raw_tail=b"this is not json\n")
    append(logs / runfolder.TRAINING_LOG, second, raw_tail=b'{"ts": 1, "step": 41, "lo')
    evals = [
        {
            "ts": t0 + 10,
            "step": 10,
            "eval_loss": 2.0,
            "perplexity": math.exp(2.0),
            "eval_tokens": 100,
            "is_best": True,
        },
        {
            "ts": t0 + 20,
            "step": 20,
            "eval_loss": 1.5,
            "perplexity": math.exp(1.5),
            "eval_tokens": 100,
            "is_best": True,
        },
        {
            "ts": t0 + 40,
            "step": 30,
            "eval_loss": 1.2,
            "perplexity": math.exp(1.2),
            "eval_tokens": 100,
            "is_best": True,
            "metrics": {"accuracy": 0.75},
            "task": "sst2",
        },
        {
            "ts": t0 + 50,
            "step": 40,
            "eval_loss": 1.3,
            "perplexity": math.exp(1.3),
            "eval_tokens": 100,
            "is_best": False,
        },
    ]
    append(logs / runfolder.EVAL_LOG, evals)
    ck = lambda step, ts, value: {  # noqa: E731
        "ts": ts,
        "event": "checkpoint_saved",
        "step": step,
        "path": f"/elsewhere/demo/checkpoint-{step}",
        "size_bytes": 4096 * step,
        "metric": "eval_loss",
        "metric_value": value,
        "kind": "periodic",
    }
    events = [
        {
            "ts": t0,
            "event": "run_start",
            "step": None,
            "resumed": False,
            "world_size": 1,
            "total_steps": TOTAL_STEPS,
        },
        ck(10, t0 + 10, 2.0),
        ck(20, t0 + 20, 1.5),
        {
            "ts": t0 + 26,
            "event": "resume",
            "step": RESUME_STEP,
            "from_checkpoint": "/elsewhere/demo/checkpoint-20",
        },
        {
            "ts": t0 + 26,
            "event": "run_start",
            "step": RESUME_STEP,
            "resumed": True,
            "world_size": 1,
            "total_steps": 60,
        },
        ck(30, t0 + 40, 1.2),
        {
            "ts": t0 + 40,
            "event": "best_updated",
            "step": 30,
            "metric": "eval_loss",
            "metric_value": 1.2,
            "path": "/elsewhere/demo/checkpoint-30",
        },
        {"ts": t0 + 41, "event": "checkpoint_pruned", "step": None, "path": "/elsewhere/demo/checkpoint-10"},
        {"ts": t0 + 43, "event": "step_skipped", "step": NAN_STEP, "reason": "nonfinite_loss"},
        ck(40, t0 + 50, 1.3),
    ]
    append(logs / runfolder.EVENTS_LOG, events)
    for step, value in ((20, 1.5), (30, 1.2), (40, 1.3)):
        write_checkpoint(run, step, value)
    gpu = []
    for i in range(12):
        ts = now - 60 + 5 * i
        gpu.append(
            {
                "ts": ts,
                "host": "node1",
                "device": "cuda:0",
                "name": "H100",
                "util_pct": 50 + i,
                "mem_used_mb": 1000 + 10 * i,
                "mem_total_mb": 80000,
                "temp_c": 60,
                "power_w": 300,
            }
        )
        gpu.append(
            {
                "ts": ts,
                "host": "node1",
                "device": "cuda:1",
                "name": "H100",
                "util_pct": 40 + i,
                "mem_used_mb": 2000 + 10 * i,
                "mem_total_mb": 80000,
                "temp_c": 61,
                "power_w": 310,
            }
        )
        gpu.append(
            {
                "ts": ts,
                "host": "node1",
                "device": "cpu",
                "cpu_pct": 20.0,
                "ram_used_mb": 5000,
                "ram_total_mb": 16000,
            }
        )
    append(logs / runfolder.GPU_LOG, gpu)
    append(
        logs / runfolder.EXPERT_LOG,
        [
            expert_window(10, 1, [1, 1, 1, 1]),
            expert_window(20, 11, [4, 2, 1, 1]),
            expert_window(20, 11, [5, 1, 1, 1]),
            expert_window(30, 21, [1, 1, 1, 5]),
        ],
    )
    append(logs / runfolder.ERROR_LOG, [])


def expert_window(step: int, start: int, weights: list[int]) -> dict:
    layers = []
    for layer in range(LAYERS):
        counts = [w * 10 * (layer + 1) for w in weights]
        total = sum(counts)
        layers.append(
            {
                "layer": layer,
                "name": f"model.layers.{layer}.mlp.gate",
                "counts": counts,
                "fractions": [c / total for c in counts],
                "tokens": total // 2,
                "imbalance": max(counts) / (total / len(counts)),
                "entropy": 1.0,
            }
        )
    return {
        "ts": time.time(),
        "step": step,
        "start_step": start,
        "num_experts": EXPERTS,
        "top_k": 2,
        "layers": layers,
    }


def build_failed(run: Path, now: float) -> None:
    """A run that died at step 5 with an error and a traceback."""
    logs = run / runfolder.LOGS_DIR
    t0 = now - 3600
    write_run_json(
        run,
        {"run_id": "failed-1", "started_at": t0, "status": "failed", "ended_at": t0 + 6, "total_steps": 10},
    )
    append(logs / runfolder.TRAINING_LOG, [train_record(s, t0 + s, 2.0, total=10) for s in range(1, 6)])
    append(logs / runfolder.EVENTS_LOG, [{"ts": t0, "event": "run_start", "step": None, "resumed": False}])
    append(
        logs / runfolder.ERROR_LOG,
        [
            {
                "ts": t0 + 6,
                "step": 5,
                "type": "RuntimeError",
                "message": "CUDA out of memory",
                "rank": 0,
                "traceback": 'Traceback (most recent call last):\n  File "loop.py", line 1\nRuntimeError: CUDA out of memory\n',
            }
        ],
    )


def write_config(run: Path, learning_rate: float, rank: int, method: str = "lora") -> None:
    """A saved config.yaml as the trainer writes it (the config panel, diff and overview columns read it)."""
    (run / runfolder.CONFIG_YAML).write_text(
        f"model:\n  name_or_path: configs/tiny-moe\ntraining:\n  method: {method}\n  micro_batch_size: 8\n"
        f"  gradient_accumulation_steps: 2\noptimization:\n  learning_rate: {learning_rate}\n  lr_scheduler: cosine\n"
        f"lora:\n  r: {rank}\n  alpha: 32\n"
    )


def build_log_root(base: Path, now: float | None = None) -> Path:
    """The log root used by most dashboard tests; ``base/secret`` lies outside it."""
    now = time.time() if now is None else now
    root = base / "runs"
    build_demo(root / DEMO, now)
    build_failed(root / "failed", now - 10)
    write_config(root / DEMO, 3e-3, 16)
    write_config(root / "failed", 1e-4, 8)
    # Logs that exist but are empty, and a run with only run.json.
    empty_logs = root / "empty" / runfolder.LOGS_DIR
    empty_logs.mkdir(parents=True)
    for name in runfolder.LOG_FILES:
        (empty_logs / name).write_bytes(b"")
    write_run_json(root / "bare", {"run_id": "bare", "started_at": now - 7200, "status": "running"})
    # Nothing but garbage: a broken run.json and logs full of junk.
    junk = root / "junk"
    (junk / runfolder.LOGS_DIR).mkdir(parents=True)
    (junk / runfolder.RUN_JSON).write_text("{not json")
    for name in runfolder.LOG_FILES:
        (junk / runfolder.LOGS_DIR / name).write_bytes(
            b'[1,2]\n"text"\n{"step": "x"}\n\xff\xfe\n{{{{\n' + b"[" * 100000 + b"\n"
        )
    # A nested run (a sweep folder holding trials).
    append(
        root / "sweep" / "lr-1e-4" / runfolder.LOGS_DIR / runfolder.TRAINING_LOG,
        [train_record(1, now - 7300, 2.5)],
    )
    write_config(root / "sweep" / "lr-1e-4", 1e-4, 16)
    # Outside the root: a run folder a symlink inside the root points at.
    secret = base / "secret"
    append(secret / runfolder.LOGS_DIR / runfolder.TRAINING_LOG, [train_record(1, now, 9.99)])
    (secret / "passwords.txt").write_text("hunter2\n")
    (root / "escape").symlink_to(secret, target_is_directory=True)
    # Runs without started_at sort by folder time: keep them older than the demo run.
    for folder in ("empty", "junk", "sweep"):
        for path in [root / folder, *(root / folder).rglob("*")]:
            os.utime(path, (now - 9000, now - 9000))
    return root


# The dashboard's number format (dashboard/views.py `format_number`, static/charts.js `fmt`):
# (value as text, significant digits, what both show). Text, so NaN survives the trip into the browser.
NUMBER_CASES = [
    ("40980.4", 4, "40,980"),  # tokens/s of a fast run: never 4.098e+04
    ("7648.0", 4, "7,648"),  # and of a slow one, the same way
    ("1040", 4, "1,040"),
    ("123456789.7", 4, "123,456,790"),  # no exponent for large counts either
    ("1000.5", 4, "1,001"),  # halves round up on both sides
    ("999.96", 4, "1,000"),  # rounds up into the separated range
    ("12.3456", 4, "12.35"),
    ("0.1234567", 4, "0.1235"),
    ("-0.5", 4, "-0.5"),
    ("0", 4, "0"),
    ("0.001", 4, "0.001"),
    ("3e-4", 3, "3e-4"),  # learning rates keep an exponent
    ("2.5e-5", 4, "2.5e-5"),
    ("0.00099996", 4, "1e-3"),
    ("NaN", 4, "-"),
    ("Infinity", 4, "-"),
]
