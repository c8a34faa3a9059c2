"""What each log's records hold: one typed builder per record kind, and the JSON line encoding.

Why typed builders: a record's fields are named here once. ``REQUIRED_FIELDS`` (the contract the
tests check), the dashboard's list of known series and the writers all derive from these classes,
so a new log field is one edit here (plus its line in docs/run-folder.md).
Fields without a default are always written; optional ones (default None) are left out when None.
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
    total_steps: int
    epoch: float
    loss: float
    lr: float
    grad_norm: float | None
    tokens: int
    tokens_per_sec: float
    steps_per_sec: float
    eta_seconds: float
    elapsed: float
    peak_mem_mb: float | None
    aux_loss: float | None = None  # MoE router load-balancing loss
    skipped: bool | None = None  # the update was skipped (non-finite loss or gradient norm)


@dataclass
class EvalRecord(Record):
    """eval_log.jsonl: one per evaluation; ``metric_for_best``/``greater_is_better`` name the rule
    the trainer ranked it by, so every reader picks the same best (trainer.runfolder.best)."""

    LOG: ClassVar[str] = EVAL_LOG
    step: int
    eval_loss: float | None
    perplexity: float | None
    eval_tokens: int | None
    task: str | None = None
    metrics: dict | None = None
    samples: list | None = None
    is_best: bool | None = None
    metric_for_best: str | None = None
    greater_is_better: bool | None = None
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
    start_step: int
    num_experts: int
    top_k: int
    layers: list


@dataclass
class ErrorRecord(Record):
    """error_log.jsonl: a fatal error, written before the exception propagates."""

    LOG: ClassVar[str] = ERROR_LOG
    step: int | None
    type: str
    message: str
    traceback: str
    rank: int | None = None


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
