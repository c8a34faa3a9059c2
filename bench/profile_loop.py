"""Where the real loop's step time goes on the GPU, beside the bare step of ``profile_fast_path.py``.

Runs ``python -m trainer train`` in this process on bench_core_gpu's config (Llama-1B shape, one long
document) with two probes: the wall time of every loop iteration against the time inside the step itself
(``OomFallback.run``: forward, backward, accumulation), and a torch.profiler window over a few steady steps
whose CPU ops are listed by self time. The difference between the two says what the loop adds per step.

    python bench/profile_loop.py --model DIR --method lora --gc --out /tmp/pl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    from bench.profile_fast_path import host_probe, model_arguments, pick_sdpa_backend

    parser = argparse.ArgumentParser()
    model_arguments(parser)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--profile-from", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--out", default="/tmp/profile-loop")
    parser.add_argument(
        "--unwrap-forward",
        action="store_true",
        help="drop accelerate's autocast/fp32 forward wrapper (lever test)",
    )
    parser.add_argument(
        "--trace", action="store_true", help="also write the profile window as a gzipped Chrome trace"
    )
    parser.add_argument("--sdpa", choices=["default", "flash", "efficient"], default="default")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() before the first step (lever test)"
    )
    parser.add_argument(
        "--set", action="append", default=[], help="section.key=value overrides (YAML values)"
    )
    args = parser.parse_args()

    import torch
    import yaml
    from torch.profiler import ProfilerActivity, profile

    from bench.bench_core_gpu import ALL_LINEAR, trainer_config
    from trainer.cli import main as trainer_main
    from trainer.training import oom_retry

    extra = {}
    for item in args.set:
        key, value = item.split("=", 1)
        extra[key] = yaml.safe_load(value)
    out = Path(args.out) / f"{args.method}{'-gc' if args.gc else ''}"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = trainer_config(out, Path(args.model), args.method, args.steps, args.gc, ALL_LINEAR, **extra)
    inside, entries, prof_box = [], [], {}
    original = oom_retry.OomFallback.run

    def probed(self, done, shape, attempt, save_before_failing):
        if not entries:
            model = attempt.func.model
            if args.unwrap_forward and hasattr(model, "_original_forward"):
                model.forward = model._original_forward
            if args.gc_freeze:
                import gc

                gc.collect()
                gc.freeze()
        if done + 1 == args.profile_from - 1:
            prof_box["host"] = host_probe()
        entries.append(time.perf_counter())
        if done + 1 == args.profile_from:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            prof_box["prof"] = prof
        started = time.perf_counter()
        result = original(self, done, shape, attempt, save_before_failing)
        inside.append(time.perf_counter() - started)
        if done + 1 == args.profile_from + args.profile_steps - 1 and "prof" in prof_box:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof_box["prof"].__exit__(None, None, None)
            if args.trace:
                import gzip
                import shutil

                raw = out.parent / f"{out.name}-trace.json"
                prof_box["prof"].export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return result

    oom_retry.OomFallback.run = probed
    pick_sdpa_backend(args.sdpa)
    code = trainer_main(["train", "--config", str(config)])
    iterations = [b - a for a, b in zip(entries, entries[1:])][4:]
    if code != 0 or not iterations:
        print(f"LOOP {json.dumps({'exit': code, 'steps': len(inside)})}", flush=True)
        return 1
    row = {
        "exit": code,
        "iteration_s_median": round(statistics.median(iterations), 4),
        "inside_step_s_median": round(statistics.median(inside[4:]), 4),
    }
    row["host"] = prof_box.get("host")
    prof = prof_box.get("prof")
    if prof is not None:
        n = args.profile_steps
        cpu = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
        cuda = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        row["gpu_busy_ms_per_step"] = round(sum(e.self_device_time_total for e in cuda) / 1000 / n, 1)
        row["cpu_self_ms_per_step"] = {
            e.key[:70]: round(e.self_cpu_time_total / 1000 / n, 2)
            for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:30]
        }
        row["cpu_total_ms_per_step"] = {
            e.key[:70]: round(e.cpu_time_total / 1000 / n, 2)
            for e in sorted(cpu, key=lambda e: -e.cpu_time_total)[:30]
        }
    print("LOOP", json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
