"""The run folder: the contract between the trainer and everything that reads its output.

Both sides import this package; it imports nothing from either (standard library only, no torch),
so dependencies run trainer -> run folder <- dashboard. docs/run-folder.md describes the format.

- ``layout``: every file and folder name (run.json, logs/*.jsonl, checkpoint-<step>, sweep.json).
- ``records``: what each log's records hold (typed builders, ``REQUIRED_FIELDS``) and the JSON line encoding.
- ``writer``: ``RunLog``, the only writer of logs and run.json.
- ``reader``: the one incremental JSONL reader (``LogTail``) and the one-shot reads built on it.
- ``discovery``: run folders and sweeps under a root; folder sizes.
- ``best``: the one rule for "best evaluation" (``MetricForBest``, ``best_evaluation``).
- ``columns``, ``rundata``, ``summaries``: a run folder held in memory and refreshed incrementally
  (the dashboard's model, also used by reports).
- ``series``, ``plots``: downsampling, smoothing and matplotlib figures of a run (need numpy and
  matplotlib, so they are imported only by code that draws: the dashboard and ``trainer.reports.report``).

This module re-exports the names most code needs: ``from trainer import runfolder`` then
``runfolder.EVAL_LOG``, ``runfolder.iter_records(...)``, ``runfolder.best_evaluation(...)``.
"""

from trainer.runfolder.best import (
    LOSS,
    Best,
    MetricForBest,
    Official,
    best_evaluation,
    config_metric,
    guess_greater_is_better,
    metric_value,
    official_metrics,
    run_metrics,
)
from trainer.runfolder.discovery import MAX_DEPTH, find_run_folders, find_sweeps, folder_size, sweep_jobs
from trainer.runfolder.layout import (
    BEST_ADAPTER_DIR,
    CHECKPOINT_PREFIX,
    CONFIG_RESUME,
    CONFIG_YAML,
    DATA_REPORT_JSON,
    DATA_REPORT_MD,
    ERROR_LOG,
    EVAL_LOG,
    EVENTS_LOG,
    EXPERT_LOG,
    FINAL_PREFIX,
    GPU_LOG,
    LOG_FILES,
    LOGS_DIR,
    LORA_GA_INIT,
    PEFT_METHOD_JSON,
    PEFT_METHOD_TENSORS,
    PLAN_JSON,
    PLANNED_CONFIG,
    PROFILE_DIR,
    REPORT_DIR,
    RUN_JSON,
    SDLORA_SELECTION,
    STATUSES,
    SWEEP_JSON,
    TMP_PREFIX,
    TRACKERS_DIR,
    TRAINER_STATE,
    TRAINING_LOG,
    TRAINING_STATE_DIR,
    checkpoint_step,
    is_run_folder,
    log_path,
)
from trainer.runfolder.reader import (
    LogTail,
    inside,
    iter_records,
    last_per_step,
    read_json_object,
    read_log,
    read_run_json,
    tail_records,
)
from trainer.runfolder.records import (
    EVENTS,
    REQUIRED_FIELDS,
    ErrorRecord,
    EvalRecord,
    ExpertRecord,
    Record,
    TrainRecord,
    clean_value,
    encode_record,
)
from trainer.runfolder.slurm import slurm_job, slurm_row
from trainer.runfolder.writer import RunLog, write_json_atomic

__all__ = [
    "BEST_ADAPTER_DIR",
    "CHECKPOINT_PREFIX",
    "CONFIG_RESUME",
    "CONFIG_YAML",
    "DATA_REPORT_JSON",
    "DATA_REPORT_MD",
    "ERROR_LOG",
    "EVAL_LOG",
    "EVENTS",
    "EVENTS_LOG",
    "EXPERT_LOG",
    "FINAL_PREFIX",
    "GPU_LOG",
    "LOG_FILES",
    "LOGS_DIR",
    "LOSS",
    "MAX_DEPTH",
    "REPORT_DIR",
    "REQUIRED_FIELDS",
    "RUN_JSON",
    "LORA_GA_INIT",
    "PEFT_METHOD_JSON",
    "PEFT_METHOD_TENSORS",
    "PLAN_JSON",
    "PLANNED_CONFIG",
    "PROFILE_DIR",
    "SDLORA_SELECTION",
    "STATUSES",
    "SWEEP_JSON",
    "TMP_PREFIX",
    "TRACKERS_DIR",
    "TRAINER_STATE",
    "TRAINING_LOG",
    "TRAINING_STATE_DIR",
    "Best",
    "ErrorRecord",
    "EvalRecord",
    "ExpertRecord",
    "LogTail",
    "MetricForBest",
    "Official",
    "Record",
    "RunLog",
    "TrainRecord",
    "best_evaluation",
    "checkpoint_step",
    "config_metric",
    "clean_value",
    "encode_record",
    "find_run_folders",
    "find_sweeps",
    "folder_size",
    "guess_greater_is_better",
    "inside",
    "is_run_folder",
    "iter_records",
    "last_per_step",
    "log_path",
    "metric_value",
    "official_metrics",
    "read_json_object",
    "read_log",
    "read_run_json",
    "run_metrics",
    "slurm_job",
    "slurm_row",
    "sweep_jobs",
    "tail_records",
    "write_json_atomic",
]
