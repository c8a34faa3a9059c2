"""The shape every evaluation task shares, so the trainer treats GLUE and text-to-SQL alike.

The trainer's evaluation only needs: examples of a split, a prompt per example, and a score
for generated answers; ``target`` gives the gold answer text, for building training records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class TaskDataError(RuntimeError):
    """A task's data could not be found or read; the message says where it looked and what it expected."""


@dataclass(frozen=True)
class MetricForBest:
    """The metric that picks the best checkpoint, and which direction is better."""

    name: str
    greater_is_better: bool = True

    def is_better(self, value: float, best: float | None) -> bool:
        """True when ``value`` beats ``best`` (any finite value beats None or NaN)."""
        if value != value:  # NaN never wins
            return False
        if best is None or best != best:
            return True
        return value > best if self.greater_is_better else value < best


class Task(ABC):
    """A generation-evaluated task: ``score(generate(prompt(e) for e in examples), examples)``."""

    name: str
    metric_for_best: MetricForBest
    max_new_tokens: int = 16  # a sensible generation budget for this task's answers

    @abstractmethod
    def load(self, split: str) -> list[dict]:
        """Examples of ``split`` (``train``, ``validation``, ...), each a plain dict."""

    @abstractmethod
    def prompt(self, example: dict) -> str:
        """The text the model continues; it ends where the answer starts."""

    @abstractmethod
    def target(self, example: dict) -> str:
        """The gold continuation of ``prompt(example)`` (starts with a space)."""

    @abstractmethod
    def score(self, predictions: list[str], examples: list[dict]) -> dict[str, float]:
        """Task metrics for generated continuations, one per example, in order."""

    def record(self, example: dict) -> dict:
        """An instruction record (``prompt``/``completion``) for fine-tuning on this task."""
        return {"prompt": self.prompt(example), "completion": self.target(example)}

    def _check_aligned(self, predictions: list[str], examples: list[dict]) -> None:
        if len(predictions) != len(examples):
            raise ValueError(f"{self.name}: {len(predictions)} predictions for {len(examples)} examples")
