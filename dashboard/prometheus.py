"""Prometheus text exposition (format 0.0.4) of the same numbers /api/stats and /api/gpu give.

Why: Grafana users scrape ``/metrics`` instead of polling JSON. Every sample carries a ``run``
label; GPU samples add ``host`` and ``device``. Values that are unknown (None) are left out.
"""

from __future__ import annotations

import math

from trainer import runfolder

STATUSES = (*runfolder.STATUSES, "stalled", "dead")

# (metric name, help, key in the stats dict)
RUN_GAUGES = (
    ("finetune_step", "Optimizer step of the newest training record.", "step"),
    ("finetune_total_steps", "Planned optimizer steps.", "total_steps"),
    ("finetune_progress_ratio", "step / total_steps.", "progress"),
    ("finetune_loss", "Training loss of the newest record.", "loss"),
    ("finetune_loss_smoothed", "Bias-corrected EMA (0.6) of the training loss.", "loss_smoothed"),
    ("finetune_learning_rate", "Learning rate of the newest record.", "lr"),
    ("finetune_grad_norm", "Gradient norm before clipping, newest record.", "grad_norm"),
    ("finetune_tokens_per_second", "Throughput over the last step, all ranks.", "tokens_per_sec"),
    ("finetune_eta_seconds", "Estimated seconds left.", "eta_seconds"),
    ("finetune_elapsed_seconds", "Wall-clock seconds since the run started.", "elapsed_seconds"),
    (
        "finetune_last_record_age_seconds",
        "Seconds since the newest training record.",
        "last_record_age_seconds",
    ),
    ("finetune_peak_memory_mib", "Peak accelerator memory of rank 0 (MiB).", "peak_mem_mb"),
    ("finetune_errors", "Fatal errors in error_log.jsonl.", "error_count"),
    ("finetune_nonfinite_records", "Training records with a non-finite value.", "nonfinite_steps"),
    ("finetune_resumes", "Resume events.", "resumes"),
)
GPU_GAUGES = (
    ("finetune_gpu_utilization_percent", "Accelerator utilisation.", "util_pct"),
    ("finetune_gpu_memory_used_mib", "Accelerator memory used (MiB).", "mem_used_mb"),
    ("finetune_gpu_memory_total_mib", "Accelerator memory total (MiB).", "mem_total_mb"),
    ("finetune_gpu_temperature_celsius", "Accelerator temperature.", "temp_c"),
    ("finetune_gpu_power_watts", "Accelerator power draw.", "power_w"),
    ("finetune_cpu_utilization_percent", "CPU utilisation of the node.", "cpu_pct"),
    ("finetune_ram_used_mib", "RAM used on the node (MiB).", "ram_used_mb"),
)


def escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels(**pairs: str) -> str:
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def number(value) -> str | None:
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return repr(value) if isinstance(value, float) else str(value)


def exposition(runs: list[dict]) -> str:
    """Text for ``/metrics`` from a list of ``{"stats": ..., "gpu": ...}`` (one per run)."""
    families: dict[str, tuple[str, list[str]]] = {}

    def add(name: str, help_text: str, label_text: str, value) -> None:
        text = number(value)
        if text is not None:
            families.setdefault(name, (help_text, []))[1].append(f"{name}{label_text} {text}")

    for entry in runs:
        stats, gpu = entry["stats"], entry["gpu"]
        run = stats["run"]
        for name, help_text, key in RUN_GAUGES:
            add(name, help_text, labels(run=run), stats.get(key))
        best = stats.get("best_eval") or {}
        add("finetune_best_eval_loss", "Best evaluation loss so far.", labels(run=run), best.get("eval_loss"))
        for status in STATUSES:
            add(
                "finetune_status",
                "1 for the run's current status.",
                labels(run=run, status=status),
                stats["status"] == status,
            )
        for file_name, count in stats.get("bad_lines", {}).items():
            add(
                "finetune_skipped_lines",
                "Garbage lines and unusable records skipped.",
                labels(run=run, file=file_name),
                count,
            )
        for device in gpu["devices"]:
            device_labels = labels(run=run, host=device.get("host") or "", device=device.get("device") or "")
            for name, help_text, key in GPU_GAUGES:
                add(name, help_text, device_labels, device.get(key))
    lines = []
    for name, (help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples]
    return "\n".join(lines) + "\n"
