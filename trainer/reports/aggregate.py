"""Results across runs: each run at its best evaluation, then mean ± std over seeds for every
(dataset, experiment), written as CSV, JSON, Markdown and a PNG plot.

A run's best evaluation is the one rule of ``trainer.runfolder.best`` (the metric the run ranked its
checkpoints by; folders that do not say: the task's official metric), so this table names the
checkpoint the run kept, as the dashboard and ``list`` do. At that evaluation the task's official
metrics are reported (``trainer.runfolder.official_metrics``: CoLA Matthews correlation; MRPC and QQP
F1 and accuracy; STS-B Pearson and Spearman; MNLI matched and mismatched accuracy; other GLUE tasks
accuracy; Spider execution accuracy and exact match; no task metric: eval loss and perplexity).

Standard library, yaml and pydantic (a run's config.yaml is read through trainer.config's models);
matplotlib only inside ``write_plot``. Runs with missing or broken logs become ``problems``, never errors.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

from trainer import runfolder
from trainer.runfolder import LOSS, MetricForBest, config_metric, metric_value, official_metrics

PATH_FIELDS = ("path", "checkpoint", "log")


def best_evaluation(
    records: list[dict], task: str | None = None, events=(), hint: MetricForBest | None = None
) -> dict | None:
    """The run's best evaluation (the one rule) and the task's official metrics read at it.

    ``task`` stands in for one the records do not name; ``events`` and ``hint`` (the metric config.yaml
    names) matter only for folders written before eval records named their metric.
    Returns ``{task, metric, greater_is_better, value, step, metrics}`` or None when nothing scored.
    """
    best = runfolder.best_evaluation(records, events, hint, task)
    if best is None:
        return None
    named = next((r["task"] for r in reversed(records) if isinstance(r.get("task"), str)), None)
    task = named or task
    report = official_metrics(task).report if best.metric != LOSS else ("eval_loss", "perplexity")
    return {
        "task": task,
        "metric": best.metric.name,
        "greater_is_better": best.metric.greater_is_better,
        "value": best.value,
        "step": best.step,
        "metrics": {name: metric_value(best.record, name) for name in report},
    }


# ---------------------------------------------------------------- finding runs


def find_run_folders(root: Path) -> list[Path]:
    """Run folders (run.json or logs/) under root, at most MAX_DEPTH levels down; root may be one."""
    return list(runfolder.find_run_folders(root).values())


def sweep_jobs(root: Path) -> dict[str, dict]:
    """Jobs of every sweep.json under root, by their resolved output folder, with the sweep's name."""
    return runfolder.sweep_jobs(runfolder.find_sweeps(root))


def _config(run_dir: Path):
    """The run's config.yaml read by the trainer's models (keys of older versions ignored), as a dict."""
    from trainer.config import read_run_config

    config, _ignored = read_run_config(run_dir / runfolder.CONFIG_YAML)
    return config.to_dict() if config is not None else {}


def _section(config: dict, name: str) -> dict:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def derive_experiment(rel: str, dataset: str | None, seed) -> str:
    """A run's folder path with its seed (and dataset) taken out: runs differing only there group."""
    name = rel
    tokens = [rf"seed[-_=]?{re.escape(str(seed))}" if seed is not None else r"seed[-_=]?\d+"]
    if dataset:
        tokens.append(re.escape(dataset))
    for token in tokens:
        name = re.sub(rf"(^|[-_./])(?:{token})(?=$|[-_./])", r"\1", name)
    name = re.sub(r"([-_.])[-_.]+", r"\1", name)
    name = re.sub(r"[-_.]+(?=/|$)|(?<=/)[-_.]+|^[-_.]+", "", name)
    name = re.sub(r"/+", "/", name).strip("/")
    return name or rel


def _checkpoint(run_dir: Path, step) -> str | None:
    if not isinstance(step, int):
        return None
    for prefix in (runfolder.CHECKPOINT_PREFIX, runfolder.FINAL_PREFIX):
        folder = run_dir / f"{prefix}{step}"
        if folder.is_dir():
            return str(folder)
    return None


def analyze_run(run_dir: Path, root: Path, jobs: dict[str, dict]) -> tuple[dict | None, dict | None]:
    """(result row, None) for a run with a scored evaluation, else (None, problem)."""
    rel = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    job = jobs.get(os.path.realpath(run_dir), {})
    info = runfolder.read_run_json(run_dir)

    def problem(reason: str) -> tuple[None, dict]:
        return None, {"run": rel, "path": str(run_dir), "status": info.get("status"), "problem": reason}

    eval_path = run_dir / runfolder.LOGS_DIR / runfolder.EVAL_LOG
    if not eval_path.is_file():
        return problem(f"no {runfolder.LOGS_DIR}/{runfolder.EVAL_LOG}")
    records, bad = runfolder.read_log(eval_path)
    if not records:
        return problem(f"{runfolder.EVAL_LOG} has no readable records ({bad} unreadable lines)")
    config = _config(run_dir)
    eval_section = _section(config, "eval")
    task = eval_section.get("task") if isinstance(eval_section.get("task"), str) else None
    events = list(runfolder.iter_records(runfolder.log_path(run_dir, runfolder.EVENTS_LOG)))
    best = best_evaluation(records, task, events, config_metric(eval_section))
    if best is None:
        return problem(f"no finite task metric or eval_loss in {len(records)} evaluations")
    train_file = _section(config, "paths").get("train_file")
    dataset = (
        job.get("dataset") or best["task"] or (Path(train_file).stem if isinstance(train_file, str) else None)
    )
    seed = job.get("seed") if job.get("seed") is not None else _section(config, "training").get("seed")
    experiment = job.get("experiment") or derive_experiment(rel, dataset, seed)
    row = {
        "dataset": dataset or "-",
        "experiment": experiment,
        "seed": seed,
        "run": rel,
        "sweep": job.get("sweep"),
        "status": info.get("status") or ("unknown" if not info else None),
        "task": best["task"],
        "metric": best["metric"],
        "best_step": best["step"],
        "evaluations": len(runfolder.last_per_step(records)),
        "bad_lines": bad,
        "metrics": best["metrics"],
        "checkpoint": _checkpoint(run_dir, best["step"]),
        "path": str(run_dir),
    }
    return row, None


# ---------------------------------------------------------------- grouping


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); the std of a single value is None."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def group_rows(rows: list[dict]) -> list[dict]:
    """One entry per (dataset, experiment): seeds, and mean ± std of every reported metric."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["dataset"], row["experiment"]), []).append(row)
    result = []
    for (dataset, experiment), members in sorted(groups.items()):
        names: list[str] = []
        for row in members:
            names += [n for n in row["metrics"] if n not in names]
        stats = {}
        for name in names:
            values = [row["metrics"][name] for row in members if row["metrics"].get(name) is not None]
            mean, std = mean_std(values)
            stats[name] = {"mean": mean, "std": std, "n": len(values), "values": values}
        selection = sorted({row["metric"] for row in members})
        result.append(
            {
                "dataset": dataset,
                "experiment": experiment,
                "n": len(members),
                "seeds": [row["seed"] for row in members],
                "metric": selection[0] if len(selection) == 1 else "mixed: " + ", ".join(selection),
                "runs": [row["run"] for row in members],
                "unfinished": sum(1 for row in members if row["status"] != "finished"),
                "metrics": stats,
            }
        )
    return result


def aggregate(root: Path, only_finished: bool = False) -> dict:
    """Everything the outputs show: per-run rows, groups and problems."""
    root = Path(root)
    jobs = sweep_jobs(root)
    folders = find_run_folders(root)
    rows, problems = [], []
    seen = set()
    for run_dir in folders:
        seen.add(os.path.realpath(run_dir))
        row, problem = analyze_run(run_dir, root, jobs)
        if problem is not None:
            problems.append(problem)
        elif only_finished and row["status"] != "finished":
            problems.append(
                {
                    **{k: row[k] for k in ("run", "path", "status")},
                    "problem": "not finished (--only-finished)",
                }
            )
        else:
            rows.append(row)
    for path, job in sorted(jobs.items()):
        if path not in seen and job.get("state") in ("failed", "interrupted", "running"):
            problems.append(
                {
                    "run": job.get("name"),
                    "path": job.get("output_dir"),
                    "log": job.get("log"),
                    "status": job.get("state"),
                    "problem": f"sweep job without a run folder (state {job.get('state')}); see its job.log",
                }
            )
    rows.sort(key=lambda r: (r["dataset"], r["experiment"], str(r["seed"]), r["run"]))
    return {
        "root": str(root),
        "generated_at": round(time.time(), 3),
        "runs": rows,
        "groups": group_rows(rows),
        "problems": problems,
    }


# ---------------------------------------------------------------- outputs


def _drop_paths(result: dict) -> dict:
    strip = lambda items: [{k: v for k, v in item.items() if k not in PATH_FIELDS} for item in items]  # noqa: E731
    return {**result, "runs": strip(result["runs"]), "problems": strip(result["problems"])}


def _metric_names(items: list[dict]) -> list[str]:
    names: list[str] = []
    for item in items:
        names += [n for n in item["metrics"] if n not in names]
    return names


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def groups_csv(result: dict) -> str:
    names = _metric_names(result["groups"])
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        ["dataset", "experiment", "n", "seeds", "metric"]
        + [f"{n}_{s}" for n in names for s in ("mean", "std")]
    )
    for g in result["groups"]:
        cells = []
        for name in names:
            stat = g["metrics"].get(name) or {}
            cells += [_fmt(stat.get("mean")), _fmt(stat.get("std"))]
        seeds = " ".join(str(s) for s in g["seeds"])
        writer.writerow([g["dataset"], g["experiment"], g["n"], seeds, g["metric"], *cells])
    return out.getvalue()


def runs_csv(result: dict, small: bool) -> str:
    names = _metric_names(result["runs"])
    fixed = ["dataset", "experiment", "seed", "run", "sweep", "status", "task", "metric", "best_step"]
    tail = [] if small else list(PATH_FIELDS)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fixed + names + tail)
    for row in result["runs"]:
        writer.writerow(
            [_fmt(row[k]) for k in fixed]
            + [_fmt(row["metrics"].get(n)) for n in names]
            + [row.get(k) or "" for k in tail]
        )
    return out.getvalue()


def mean_pm_std(stat: dict | None) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    if stat.get("std") is None:
        return f"{stat['mean']:.4f}"
    return f"{stat['mean']:.4f} ± {stat['std']:.4f}"


def markdown(result: dict, small: bool = False) -> str:
    lines = [f"# Results: {result['root']}" if not small else "# Results", ""]
    by_dataset: dict[str, list[dict]] = {}
    for g in result["groups"]:
        by_dataset.setdefault(g["dataset"], []).append(g)
    if not by_dataset:
        lines += ["No run had a scored evaluation.", ""]
    for dataset, groups in by_dataset.items():
        names = _metric_names(groups)
        lines += [f"## {dataset}", "", "| experiment | n | " + " | ".join(names) + " |"]
        lines.append("|---|---:|" + "---:|" * len(names))
        for g in groups:
            mark = " *" if g["unfinished"] else ""
            cells = " | ".join(mean_pm_std(g["metrics"].get(n)) for n in names)
            lines.append(f"| {g['experiment']}{mark} | {g['n']} | {cells} |")
        lines.append("")
    lines.append("Mean ± sample standard deviation over seeds, each run at its best evaluation by the task's")
    lines.append("official metric (the first column). `*`: the group holds a run that has not finished.")
    if result["problems"]:
        lines += ["", "## Runs left out", ""]
        for p in result["problems"]:
            where = "" if small else f" (`{p.get('path')}`)"
            lines.append(f"- {p['run']}{where}: {p['problem']}")
    return "\n".join(lines) + "\n"


def write_plot(result: dict, path: Path) -> None:
    """One panel per dataset: each experiment's first metric, mean with a ± std error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_dataset: dict[str, list[dict]] = {}
    for g in result["groups"]:
        by_dataset.setdefault(g["dataset"], []).append(g)
    panels = max(1, len(by_dataset))
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    tallest = max((len(gs) for gs in by_dataset.values()), default=1)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, (1.2 + 0.45 * tallest) * rows), squeeze=False)
    for ax in axes.flat[len(by_dataset) :]:
        ax.axis("off")
    if not by_dataset:
        axes.flat[0].text(0.5, 0.5, "no scored runs", ha="center", va="center")
    for ax, (dataset, groups) in zip(axes.flat, by_dataset.items()):
        metric = _metric_names(groups)[0]
        stats = [g["metrics"].get(metric) or {} for g in groups]
        means = [s.get("mean") if s.get("mean") is not None else math.nan for s in stats]
        errors = [s.get("std") or 0.0 for s in stats]
        ys = range(len(groups))
        ax.barh(list(ys), means, xerr=errors, color="#1f6feb", alpha=0.8, capsize=3)
        ax.set_yticks(list(ys), [g["experiment"] for g in groups], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{dataset}: {metric}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


OUTPUT_FILES = ("results.csv", "runs.csv", "results.json", "results.md", "results.png")


def write_outputs(result: dict, out_dir: Path, small: bool = False) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = _drop_paths(result) if small else result
    if small:
        shown = {k: v for k, v in shown.items() if k != "root"}
    files = [out_dir / name for name in OUTPUT_FILES]
    files[0].write_text(groups_csv(shown))
    files[1].write_text(runs_csv(shown, small))
    files[2].write_text(json.dumps(shown, indent=2, allow_nan=False) + "\n")
    files[3].write_text(markdown({**shown, "root": result["root"]}, small))
    write_plot(shown, files[4])
    return files
