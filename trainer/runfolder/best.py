"""The one rule for "best evaluation", shared by the training loop and every reader of a run folder.

The loop ranks evaluations with ``MetricForBest.is_better`` and stamps each eval record with the
metric it ranked by (``metric_for_best``, ``greater_is_better``). A reader asks ``best_evaluation``,
which re-applies the same comparison to the records (the last record per step counts; NaN never
wins; a tie keeps the earlier step). The metric comes, first found wins, from:
1. the stamp on the eval records (every run written since the stamp exists);
2. older folders: ``hint``, the metric the run's config.yaml names (only YAML-reading callers have it);
3. the metric the run's ``checkpoint_saved``/``best_updated`` events name (direction from its name);
4. the task's official metric (``official_metrics``), else eval loss.
So the dashboard page, the runs overview, ``list`` and ``aggregate`` name the evaluation the trainer
kept as best, and agree with each other. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trainer.runfolder.reader import last_per_step
from trainer.runfolder.records import BEST_STAMP

EVAL_LOSS = "eval_loss"
PERPLEXITY = "perplexity"
CHECKPOINT_EVENTS = ("checkpoint_saved", "best_updated")


@dataclass(frozen=True)
class MetricForBest:
    """The metric that picks the best checkpoint, and which direction is better."""

    name: str
    greater_is_better: bool = True

    def is_better(self, value: float | None, best: float | None) -> bool:
        """True when ``value`` beats ``best`` (any finite value beats None or NaN; None and NaN never win)."""
        if value is None or value != value:
            return False
        if best is None or best != best:
            return True
        return value > best if self.greater_is_better else value < best


LOSS = MetricForBest(EVAL_LOSS, greater_is_better=False)


def guess_greater_is_better(name: str) -> bool:
    """The direction of a metric nobody stated one for: losses and perplexity go down, scores go up."""
    return not (name in (EVAL_LOSS, PERPLEXITY) or name.endswith("loss"))


def metric_value(record: dict | None, name: str) -> float | None:
    """A finite number from the record itself (eval_loss, ...) or its task ``metrics``; else None."""
    if not record:
        return None
    value = record.get(name)
    if value is None and isinstance(record.get("metrics"), dict):
        value = record["metrics"].get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def config_metric(eval_section: dict) -> MetricForBest | None:
    """The metric a config's ``eval`` section names explicitly (None for ``auto``, which the trainer
    resolves to the task's metric at start-up); an unset direction is guessed from the name."""
    name = eval_section.get("metric_for_best")
    if not isinstance(name, str) or name in ("", "auto"):
        return None
    greater = eval_section.get("greater_is_better")
    return MetricForBest(name, greater if isinstance(greater, bool) else guess_greater_is_better(name))


# ---------------------------------------------------------------- official task metrics


@dataclass(frozen=True)
class Official:
    """A task's official metrics: ``select`` in order of preference, ``report`` read at the best one."""

    select: tuple[MetricForBest, ...]
    report: tuple[str, ...]


# GLUE tasks scored by more than accuracy (trainer/tasks/glue.py's metric_names; a test keeps them equal).
GLUE_METRICS = {
    "cola": ("matthews_correlation", "accuracy"),
    "mrpc": ("f1", "accuracy"),
    "qqp": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
}


def official_metrics(task: str | None) -> Official:
    """CoLA MCC; MRPC/QQP F1 and accuracy; STS-B Pearson and Spearman; MNLI matched and mismatched
    accuracy; Spider execution accuracy and exact match; other tasks accuracy; no task: eval loss."""
    key = (task or "").lower().replace("-", "").replace("_", "")
    if key == "mnli":
        matched = MetricForBest("accuracy_matched")
        return Official((matched, MetricForBest("accuracy")), ("accuracy_matched", "accuracy_mismatched"))
    if key in GLUE_METRICS:
        names = GLUE_METRICS[key]
        return Official((MetricForBest(names[0]),), names)
    if key.startswith("spider") or "sql" in key:
        return Official((MetricForBest("execution_accuracy"),), ("execution_accuracy", "exact_match"))
    if key:
        return Official((MetricForBest("accuracy"),), ("accuracy",))
    return Official((LOSS,), (EVAL_LOSS, PERPLEXITY))


# ---------------------------------------------------------------- the rule


def record_task(records: Sequence[dict]) -> str | None:
    """The task named by the newest record that names one."""
    return next((r["task"] for r in reversed(records) if isinstance(r.get("task"), str)), None)


def stamped_metric(records: Sequence[dict]) -> MetricForBest | None:
    """The metric the trainer stamped on its newest stamped eval record."""
    name_key, greater_key = BEST_STAMP
    for record in reversed(records):
        name = record.get(name_key)
        if isinstance(name, str) and name:
            greater = record.get(greater_key)
            return MetricForBest(
                name, greater if isinstance(greater, bool) else guess_greater_is_better(name)
            )
    return None


def event_metric(events: Iterable[dict]) -> MetricForBest | None:
    """The metric the newest checkpoint event names (folders written before eval records were stamped)."""
    named = [
        e.get("metric")
        for e in events
        if e.get("event") in CHECKPOINT_EVENTS and isinstance(e.get("metric"), str) and e.get("metric")
    ]
    return MetricForBest(named[-1], guess_greater_is_better(named[-1])) if named else None


def run_metrics(
    evals: Sequence[dict],
    events: Iterable[dict] = (),
    hint: MetricForBest | None = None,
    task: str | None = None,
) -> tuple[MetricForBest, ...]:
    """The metric(s) a run's best evaluation is picked by, in order of trial (see the module docstring).

    ``task`` stands in for a task the records do not name (a config-reading caller knows it).
    """
    stamped = stamped_metric(evals)
    if stamped is not None:
        return (stamped,)
    if hint is not None:
        return (hint,)
    named = event_metric(events)
    if named is not None:
        return (named,)
    official = official_metrics(record_task(evals) or task)
    return (*official.select, LOSS) if LOSS not in official.select else official.select


@dataclass(frozen=True)
class Best:
    """The best evaluation: its record, the metric that picked it and that metric's value."""

    record: dict
    metric: MetricForBest
    value: float

    @property
    def step(self) -> int | None:
        return self.record.get("step")


def best_of(records: Sequence[dict], metric: MetricForBest) -> Best | None:
    """The record ``metric`` ranks first among the last record per step (ties: the earlier step)."""
    best: Best | None = None
    for record in last_per_step(list(records)):
        value = metric_value(record, metric.name)
        if metric.is_better(value, best.value if best else None):
            best = Best(record, metric, value)
    return best


def best_evaluation(
    evals: Sequence[dict],
    events: Iterable[dict] = (),
    hint: MetricForBest | None = None,
    task: str | None = None,
) -> Best | None:
    """The run's best evaluation by the one rule; None when no evaluation has a finite value for it."""
    for metric in run_metrics(evals, events, hint, task):
        best = best_of(evals, metric)
        if best is not None:
            return best
    return None
