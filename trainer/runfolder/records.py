"""What each log's records hold: one typed builder per record kind, and the JSON line encoding.

Why typed builders: a record's fields are named here once. ``REQUIRED_FIELDS`` (the contract the
tests check), the dashboard's list of known series, the writers (``RunLog.append``) and the field tables
of docs/run-folder.md (``python -m trainer.runfolder.reference``) all derive from these classes, so a new
log field is one edit here: the field and, under it, a docstring saying what it holds.
Fields without a default are always written; optional ones (default None) are left out when None.
Events (``EVENTS``), run.json and gpu_log.jsonl have no typed builder: their fields are written where they
arise, and docs/run-folder.md describes them by hand.
Non-finite floats are written as ``null`` and named in ``nonfinite``, so any JSON parser reads a line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from trainer.runfolder.layout import ERROR_LOG, EVAL_LOG, EVENTS_LOG, EXPERT_LOG, GPU_LOG, TRAINING_LOG

TS = "ts"  # Unix seconds, on every record (the writer adds it)
STEP = "step"
BEST_STAMP = ("metric_for_best", "greater_is_better")  # on eval records: the rule that ranked them
EXTRA = "extra"  # fields a record kind does not declare yet: written as they are (readers ignore them)

EVENTS = (
    "run_start",
    "resume",
    "kernel_check",
    "cuda_graphs",
    "config_changed",
    "checkpoint_saved",
    "checkpoint_pruned",
    "best_updated",
    "eval_start",
    "eval_done",
    "eval_skipped",
    "step_skipped",
    "data_report",
    "model_report",
    "length_report",
    "oom_fallback",
    "lora_ga_init",
    "sdlora_selection",
    "signal",
    "run_end",
)


class Record:
    """Base of the typed records: ``LOG`` names the file, ``as_dict`` gives what is written."""

    LOG: ClassVar[str]

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """Fields every record of this kind carries (``ts`` first)."""
        return (TS,) + tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    @classmethod
    def optional(cls) -> tuple[str, ...]:
        return tuple(
            f.name for f in dataclasses.fields(cls) if f.name not in cls.required() and f.name != EXTRA
        )

    def as_dict(self) -> dict:
        """The record as written: optional fields that are None left out, ``extra`` merged in."""
        optional = self.optional()
        record = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != EXTRA and not (f.name in optional and getattr(self, f.name) is None)
        }
        return {**record, **getattr(self, EXTRA, {})}


@dataclass
class TrainRecord(Record):
    """training_log.jsonl: one per logged optimizer step."""

    LOG: ClassVar[str] = TRAINING_LOG
    step: int
    """Optimizer step, 1-based."""
    total_steps: int
    """Planned optimizer steps."""
    epoch: float
    """Fractional epoch: rows seen / training rows."""
    loss: float
    """Mean token loss of this optimizer step (summed over micro-batches and ranks, divided by target tokens)."""
    lr: float
    """Learning rate used for this step."""
    grad_norm: float | None
    """Gradient norm before clipping."""
    tokens: int
    """Target tokens (those the loss counts) in this step, across all ranks."""
    tokens_per_sec: float
    """Input tokens per second over this step, all ranks together: from the step's start, or from the
    step before's record where that was written later (with the fused AdamW a step's loss is read after the
    next step's passes are queued, [fastpath.md](fastpath.md))."""
    steps_per_sec: float
    """Optimizer steps per second over this step."""
    eta_seconds: float
    """Estimated seconds left (a moving average of step times)."""
    elapsed: float
    """Seconds spent training in this process (since this start or resume)."""
    peak_mem_mb: float | None
    """Peak accelerator memory (MiB) of rank 0 since the last record, plus the part of CUDA graphs' memory
    pools that no live tensor holds (their replays' transient tensors, which the allocator's own peak stops
    counting once capture ends; added from the record after the capture); CPU runs: the process's RSS."""
    aux_loss: float | None = None
    """Router load-balancing loss, averaged over ranks (MoE models that return one)."""
    skipped: bool | None = None
    """True when the update was skipped: a non-finite loss or gradient norm (a step_skipped event says which)."""


@dataclass
class EvalRecord(Record):
    """eval_log.jsonl: one per evaluation; ``metric_for_best``/``greater_is_better`` name the rule
    the trainer ranked it by, so every reader picks the same best (trainer.runfolder.best)."""

    LOG: ClassVar[str] = EVAL_LOG
    step: int
    """Optimizer step after which it ran."""
    eval_loss: float | None
    """Token-weighted mean loss on the validation split; null for a task-only evaluation."""
    perplexity: float | None
    """exp(eval_loss); null for a task-only evaluation."""
    eval_tokens: int | None
    """Target tokens scored; null for a task-only evaluation."""
    task: str | None = None
    """Task name (sst2, spider, ...) of a generation-based evaluation (eval.task)."""
    metrics: dict | None = None
    """Task metrics, e.g. {"accuracy": 0.9, "unparsed": 0.0} (docs/tasks.md)."""
    samples: list | None = None
    """The task's first three examples as generated: {prompt, prediction, target} each."""
    is_best: bool | None = None
    """True when this evaluation became the best by metric_for_best when it was written (readers recompute:
    "The best evaluation" below)."""
    metric_for_best: str | None = None
    """The metric evaluations are ranked by: eval.metric_for_best resolved (auto: the task's official
    metric, else eval_loss)."""
    greater_is_better: bool | None = None
    """That metric's direction."""
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_result(cls, step: int, result: dict, metric, is_best: bool) -> EvalRecord:
        """From the evaluator's result (loss part and/or task part) and the run's ``MetricForBest``.

        A task-only evaluation writes null loss fields; result keys not declared above go to ``extra``.
        """
        declared = {f.name for f in dataclasses.fields(cls)} - {EXTRA, "step", "is_best", *BEST_STAMP}
        values = {"eval_loss": None, "perplexity": None, "eval_tokens": None}
        values.update({k: v for k, v in result.items() if k in declared})
        return cls(
            step=step,
            **values,
            is_best=is_best,
            **dict(zip(BEST_STAMP, (metric.name, metric.greater_is_better))),
            extra={k: v for k, v in result.items() if k not in declared},
        )


@dataclass
class ExpertRecord(Record):
    """expert_usage_log.jsonl: router statistics over the steps ``[start_step, step]``."""

    LOG: ClassVar[str] = EXPERT_LOG
    step: int
    """Last optimizer step of the window."""
    start_step: int
    """First optimizer step of the window."""
    num_experts: int
    """Experts per layer."""
    top_k: int
    """Experts chosen per token."""
    layers: list
    """Per router: {layer, name, counts, fractions, tokens, imbalance, entropy}: layer index, router module
    name, selections per expert (padding excluded, counted once even with gradient checkpointing),
    counts / total, tokens routed, max/mean of counts, entropy of fractions in nats."""


@dataclass
class ErrorRecord(Record):
    """error_log.jsonl: a fatal error, written before the exception propagates."""

    LOG: ClassVar[str] = ERROR_LOG
    step: int | None
    """Optimizer step reached when it failed."""
    type: str
    """The exception's class name."""
    message: str
    """The exception's message."""
    traceback: str
    """The traceback, as text."""
    rank: int | None = None
    """The process rank that wrote it."""


RECORD_TYPES = (TrainRecord, EvalRecord, ExpertRecord, ErrorRecord)

# Fields each log's records always carry (others are optional); docs/run-folder.md explains them.
REQUIRED_FIELDS = {
    **{kind.LOG: kind.required() for kind in RECORD_TYPES},
    EVENTS_LOG: (TS, "event"),
    GPU_LOG: (TS, "host", "device"),
}


def clean_value(value: Any, path: str, nonfinite: list[str]) -> Any:
    """Replace NaN/inf (at any depth) by None and remember where, so any JSON parser reads the line."""
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(path)
        return None
    if isinstance(value, dict):
        return {k: clean_value(v, f"{path}.{k}" if path else k, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_value(v, f"{path}[{i}]", nonfinite) for i, v in enumerate(value)]
    return value


def encode_record(record: dict) -> str:
    """One newline-terminated JSON line; non-finite numbers become null plus a ``nonfinite`` list."""
    nonfinite: list[str] = []
    cleaned = clean_value(record, "", nonfinite)
    if nonfinite:
        cleaned["nonfinite"] = nonfinite
    return json.dumps(cleaned, separators=(",", ":"), allow_nan=False) + "\n"
