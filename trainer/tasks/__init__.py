"""Evaluation tasks scored on generated text: GLUE (label words, official metrics) and Spider text-to-SQL.

``get_task(name, data_dir)`` builds one; every task has ``load(split)``, ``prompt(example)``,
``target(example)``, ``score(predictions, examples)`` and ``metric_for_best``. Import-light
(standard library only), so tools can list tasks without torch.
"""

from __future__ import annotations

from pathlib import Path

from trainer.tasks.base import MetricForBest, Task, TaskDataError
from trainer.tasks.glue import SPECS as GLUE_SPECS
from trainer.tasks.glue import GlueTask
from trainer.tasks.text_to_sql import SpiderTask

GLUE_TASKS = tuple(GLUE_SPECS)
TASK_NAMES = (*GLUE_TASKS, "spider")

__all__ = [
    "GLUE_TASKS",
    "TASK_NAMES",
    "GlueTask",
    "MetricForBest",
    "SpiderTask",
    "Task",
    "TaskDataError",
    "get_task",
]


def get_task(
    name: str, data_dir: str | Path | None = None, *, sql_timeout_s: float | None = None, **options
) -> Task:
    """The task called ``name``; ``data_dir`` is the GLUE download (None: the Hub) or the Spider folder.

    ``sql_timeout_s`` is Spider's per-query time limit (config ``eval.sql_timeout_s``; GLUE has no
    SQL and ignores it). ``options`` go to the task's constructor (``hf_dataset`` for GLUE).
    """
    key = name.lower().replace("-", "")
    if key in GLUE_SPECS:
        return GlueTask(key, data_dir, **options)
    if key == "spider":
        if data_dir is None:
            raise TaskDataError("spider needs data_dir: a folder with tables.json, database/ and dev.json")
        if sql_timeout_s is not None:
            options["timeout_s"] = sql_timeout_s
        return SpiderTask(data_dir, **options)
    raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASK_NAMES)}")
