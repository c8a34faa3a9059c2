"""What a run folder held in memory (``RunData``) says beyond its raw records: the best evaluation,
the checkpoints (from events and the folders on disk) and expert usage per layer.

The dashboard's pages and API and the plots (dashboard and end-of-run report) call these, so a
number means the same wherever it is shown. Standard library only.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath

from trainer.runfolder import layout
from trainer.runfolder.best import best_evaluation
from trainer.runfolder.columns import finite, record_ts
from trainer.runfolder.discovery import folder_size
from trainer.runfolder.reader import inside, read_json_object
from trainer.runfolder.rundata import RunData


def best_eval(run: RunData) -> dict | None:
    """The run's best evaluation by the one rule (``trainer.runfolder.best``): step, losses, task metrics,
    and the metric that picked it with its value."""
    best = best_evaluation(run.evals.records(), run.events.items)
    if best is None:
        return None
    record = best.record
    return {
        "step": best.step,
        "eval_loss": finite(record.get("eval_loss")),
        "perplexity": finite(record.get("perplexity")),
        "metrics": record.get("metrics") if isinstance(record.get("metrics"), dict) else None,
        "task": record.get("task"),
        "metric": best.metric.name,
        "greater_is_better": best.metric.greater_is_better,
        "value": best.value,
    }


# ---------------------------------------------------------------- checkpoints


def _name_from_path(path, fallback: str) -> str:
    return PurePosixPath(path).name if isinstance(path, str) and path else fallback


def checkpoint_rows(run: RunData) -> list[dict]:
    """Checkpoints from checkpoint_saved/pruned events and the folders on disk, by step."""
    folders = run.checkpoint_folders()
    rows: dict[str, dict] = {}
    pruned_names: set[str] = set()
    for event in run.events.items:
        kind = event["event"]
        step = event.get("step") if isinstance(event.get("step"), int) else None
        if kind == "checkpoint_saved":
            name = _name_from_path(event.get("path"), f"{layout.CHECKPOINT_PREFIX}{step}")
            rows[name] = {
                "name": name,
                "step": step if step is not None else layout.checkpoint_step(name),
                "ts": record_ts(event),
                "size_bytes": finite(event.get("size_bytes")),
                "metric": event.get("metric"),
                "metric_value": finite(event.get("metric_value")),
                "kind": event.get("kind"),
            }
            pruned_names.discard(name)
        elif kind == "checkpoint_pruned":
            pruned_names.add(_name_from_path(event.get("path"), f"{layout.CHECKPOINT_PREFIX}{step}"))
    for name, folder in folders.items():
        if name not in rows:
            rows[name] = _row_from_folder(run, name, folder)
    for name in pruned_names - rows.keys():
        rows[name] = {
            "name": name,
            "step": layout.checkpoint_step(name),
            "ts": None,
            "size_bytes": None,
            "metric": None,
            "metric_value": None,
            "kind": None,
        }
    best_name, best_step = _best_checkpoint(run, rows)
    for name, row in rows.items():
        row["on_disk"] = name in folders
        row["pruned"] = name in pruned_names or not row["on_disk"]
        row["best"] = name == best_name or (
            best_name is None and best_step is not None and row["step"] == best_step
        )
    return sorted(rows.values(), key=lambda r: (r["step"] if r["step"] is not None else -1, r["name"]))


def _row_from_folder(run: RunData, name: str, folder: dict) -> dict:
    """A checkpoint folder no event told us about: its trainer_state.json and size on disk."""
    cache_key = (name, folder["mtime"])
    cached = run.folder_cache.get(cache_key)
    if cached is None:
        state = read_json_object(folder["path"] / layout.TRAINER_STATE, run.root)
        size = folder_size(folder["path"]) if inside(folder["path"], run.root) else None
        cached = run.folder_cache[cache_key] = (state, size)
    state, size = cached
    final = name.startswith(layout.FINAL_PREFIX)
    return {
        "name": name,
        "step": folder["step"],
        "ts": finite(state.get("ts")) or folder["mtime"],
        "size_bytes": size,
        "metric": state.get("metric"),
        "metric_value": finite(state.get("metric_value")),
        "kind": "final" if final else None,
    }


def _best_checkpoint(run: RunData, rows: dict[str, dict]) -> tuple[str | None, int | None]:
    """The last best_updated event names the best checkpoint (by folder name, else by step)."""
    for event in reversed(run.events.items):
        if event["event"] == "best_updated":
            step = event.get("step") if isinstance(event.get("step"), int) else None
            name = _name_from_path(event.get("path"), "")
            return (name if name in rows else None), step
    best = best_eval(run)
    return None, (best["step"] if best else None)


# ---------------------------------------------------------------- experts


def experts(run: RunData, window: str, from_step: int | None, to_step: int | None) -> dict:
    """Expert selection per layer summed over the chosen windows: counts, fractions, balance.

    ``window``: ``latest`` (the last logged window), ``all``, or ``range`` with
    ``from_step``/``to_step`` (windows whose end step falls in it, inclusive).
    """
    with run.lock:
        steps = run.experts.steps()
        if window == "latest":
            chosen = steps[-1:]
        elif window == "all":
            chosen = steps
        else:
            lo = from_step if from_step is not None else 0
            hi = to_step if to_step is not None else math.inf
            chosen = [s for s in steps if lo <= s <= hi]
        windows = [run.experts.windows[s] for s in chosen]
        layers = _sum_layers(windows)
        first = windows[0] if windows else {}
        last = windows[-1] if windows else {}
        return {
            "run": run.name,
            "window": window,
            "windows": len(windows),
            "available_steps": steps,
            "from_step": first.get("start_step"),
            "to_step": last.get("step"),
            "num_experts": last.get("num_experts"),
            "top_k": last.get("top_k"),
            "layers": layers,
            "matrix": [layer["fractions"] for layer in layers],
        }


def _sum_layers(windows: list[dict]) -> list[dict]:
    totals: dict[int, dict] = {}
    for window in windows:
        for layer in window["layers"]:
            entry = totals.setdefault(
                layer["layer"], {"layer": layer["layer"], "name": layer["name"], "counts": []}
            )
            counts = entry["counts"]
            if len(counts) < len(layer["counts"]):
                counts.extend([0.0] * (len(layer["counts"]) - len(counts)))
            for i, value in enumerate(layer["counts"]):
                counts[i] += value
    return [_balance(totals[k]) for k in sorted(totals)]


def _balance(entry: dict) -> dict:
    counts = entry["counts"]
    total = sum(counts)
    fractions = [c / total if total else 0.0 for c in counts]
    mean = total / len(counts) if counts else 0.0
    entropy = -sum(f * math.log(f) for f in fractions if f > 0)
    return {
        **entry,
        "counts": [int(c) if float(c).is_integer() else c for c in counts],
        "fractions": fractions,
        "selections": total,
        "imbalance": (max(counts) / mean) if mean else None,
        "entropy": entropy,
        "max_entropy": math.log(len(counts)) if counts else None,
    }


def kernels(run: RunData) -> dict | None:
    """Which kernels trained the run and whether they passed their start-up self-check (the run header).

    From the last ``model_report``, ``kernel_check`` and ``cuda_graphs`` events; None for runs that logged neither
    of the first two."""
    report = check = graphs = None
    for event in run.events.items:
        if event.get("event") == "model_report":
            report = event
        elif event.get("event") == "kernel_check":
            check = event
        elif event.get("event") == "cuda_graphs":
            graphs = event
    if report is None and check is None:
        return None
    fast = (report or {}).get("fast_path") if isinstance((report or {}).get("fast_path"), dict) else {}
    results = [
        r for r in ((check or {}).get("results") or fast.get("self_check") or []) if isinstance(r, dict)
    ]
    errors = [e for e in (finite(r.get("error")) for r in results) if e is not None]
    failed = [r.get("kernel") for r in results if r.get("passed") is not True]
    path = (report or {}).get("kernel_path")
    graphs_state = (graphs or {}).get("state")
    if path not in (None, "transformers"):  # a family's own kernels (GLA, Mamba): the path that trained
        summary = f"kernels: {path}"
        if failed:
            summary += f", after a failed kernel self-check ({', '.join(map(str, failed))})"
        elif errors:
            summary += f", checked (max error {max(errors):.1e})"
    elif failed:
        summary = f"reference path: kernel self-check FAILED ({', '.join(map(str, failed))})"
    elif fast.get("enabled"):
        summary = "fast path" + {"replaying": " + CUDA graphs", "off": " (CUDA graphs off)"}.get(
            graphs_state, ""
        )
        summary += f", kernels checked (max error {max(errors):.1e})" if errors else ""
    elif fast:
        summary = f"reference path ({fast.get('reason') or 'fast path off'})"
    else:
        summary = f"kernels: {path or 'unknown'}"
    return {
        "summary": summary,
        "kernel_path": path,
        "fast_path": fast.get("enabled"),
        "fast_path_reason": fast.get("reason") or None,
        "self_check_passed": all(r.get("passed") is True for r in results) if results else None,
        "self_check_max_error": max(errors) if errors else None,
        "self_check_failed": failed,
        "cuda_graphs": {"state": graphs_state, "detail": graphs.get("detail")} if graphs else None,
    }
