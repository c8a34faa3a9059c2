"""The shape every evaluation task shares, so the trainer treats GLUE and text-to-SQL alike.

The trainer's evaluation only needs: examples of a split, a prompt per example, and a score
for generated answers; ``target`` gives the gold answer text, for building training records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

# The metric type lives with the one rule for "best" that readers of a run folder share.
from trainer.runfolder.best import MetricForBest

__all__ = ["MetricForBest", "Task", "TaskDataError"]


class TaskDataError(RuntimeError):
    """A task's data could not be found or read; the message says where it looked and what it expected."""


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
    def score(self, predictions: list[str], examples: list[dict], stop_check=None) -> dict[str, float]:
        """Task metrics for generated continuations, one per example, in order.

        A task whose scoring can take long (running SQL) calls ``stop_check()`` between predictions, the
        same number of times for the same predictions; it may raise (a SIGTERM during training)."""

    def answer_words(self) -> tuple[str, ...]:
        """The fixed words an answer must contain whole to be scored (GLUE's label words); none by default."""
        return ()

    def record(self, example: dict) -> dict:
        """An instruction record (``prompt``/``completion``) for fine-tuning on this task."""
        return {"prompt": self.prompt(example), "completion": self.target(example)}

    def _check_aligned(self, predictions: list[str], examples: list[dict]) -> None:
        if len(predictions) != len(examples):
            raise ValueError(f"{self.name}: {len(predictions)} predictions for {len(examples)} examples")
