"""Where things are in a run folder (and a sweep root): every file and folder name, in one place.

docs/run-folder.md describes what each holds. Nothing else in the kit spells these names.
"""

from __future__ import annotations

from pathlib import Path

RUN_JSON = "run.json"
CONFIG_YAML = "config.yaml"
CONFIG_RESUME = "config-resume-{step}.yaml"  # a resume's config that differs from config.yaml: .format(step=)
DATA_REPORT_JSON = "data_report.json"  # token-length report (trainer.data.length_report)
DATA_REPORT_MD = "data_report.md"  # ... the same, to read
REPORT_DIR = "report"  # end-of-run report (trainer.reports.report)
PLAN_JSON = "plan.json"  # `plan` / `train --auto-plan`: every candidate measured, and the choice
PLANNED_CONFIG = "planned_config.yaml"  # `plan`'s config with the choice
TRACKERS_DIR = "trackers"  # TensorBoard / W&B / MLflow files (logging.report_to)
PROFILE_DIR = (
    "profile"  # torch.profiler traces of chosen steps (performance.profile_from, trainer.training.profiling)
)
LOGS_DIR = "logs"
TRAINING_LOG = "training_log.jsonl"
EVAL_LOG = "eval_log.jsonl"
EXPERT_LOG = "expert_usage_log.jsonl"
EVENTS_LOG = "events.jsonl"
ERROR_LOG = "error_log.jsonl"
GPU_LOG = "gpu_log.jsonl"
LOG_FILES = (TRAINING_LOG, EVAL_LOG, EXPERT_LOG, EVENTS_LOG, ERROR_LOG, GPU_LOG)

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_PREFIX = "final-checkpoint-"
BEST_ADAPTER_DIR = "best-adapter"
TMP_PREFIX = ".tmp-"  # a checkpoint (or best-adapter copy) being written: renamed without it once whole
TRAINER_STATE = "trainer_state.json"  # inside each checkpoint folder
TRAINING_STATE_DIR = "training_state"  # ... and accelerate's save_state (optimizer, scheduler, RNG states)
# LoRA-GA and SDLoRA (trainer/peft_methods): written once at set-up, reused by every resume and restart
LORA_GA_INIT = "lora_ga_init.safetensors"
SDLORA_SELECTION = "sdlora_selection.json"
# ... and inside each checkpoint folder beside the adapter: the method, and the tensors it needs beyond PEFT's
PEFT_METHOD_JSON = "peft_method.json"
PEFT_METHOD_TENSORS = "peft_method.safetensors"

SWEEP_JSON = "sweep.json"  # <sweep root>/sweep.json, written by trainer.sweep

STATUSES = ("running", "finished", "failed", "interrupted")


def log_path(run_dir: str | Path, log_name: str) -> Path:
    """``<run_dir>/logs/<log_name>``."""
    return Path(run_dir) / LOGS_DIR / log_name


def checkpoint_step(name: str) -> int | None:
    """Step number of a ``checkpoint-<step>`` or ``final-checkpoint-<step>`` folder name, else None."""
    for prefix in (FINAL_PREFIX, CHECKPOINT_PREFIX):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return int(name[len(prefix) :])
    return None


def is_run_folder(path: Path) -> bool:
    """A run folder holds run.json or logs/."""
    return (path / RUN_JSON).is_file() or (path / LOGS_DIR).is_dir()
