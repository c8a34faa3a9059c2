"""Experiment trackers (W&B, MLflow, TensorBoard, ... through accelerate), named in ``logging.report_to``.

Every question "is a tracker on?" is answered here, so the loop just calls ``trackers.log_*``.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import Config
from trainer.runfolder import TRACKERS_DIR


def accelerator_kwargs(cfg: Config) -> dict:
    """What ``Accelerator(...)`` needs to know about trackers (nothing when none is configured)."""
    if not cfg.logging.report_to:
        return {}
    return {"log_with": cfg.logging.report_to, "project_dir": str(Path(cfg.paths.output_dir) / TRACKERS_DIR)}


def flat_config(cfg: Config) -> dict:
    """section.key -> value, the flat form trackers show as hyperparameters."""
    flat = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def eval_metrics(result: dict) -> dict:
    metrics = {f"eval/{k}": v for k, v in (result.get("metrics") or {}).items()}
    if result.get("eval_loss") is not None:
        metrics["eval/loss"] = result["eval_loss"]
    return metrics


class Trackers:
    """The run's trackers; every method does nothing when ``logging.report_to`` is empty."""

    def __init__(self, accelerator, cfg: Config):
        self.accelerator = accelerator
        self.enabled = bool(cfg.logging.report_to)
        self.started = False

    def start(self, run_name: str, cfg: Config) -> Trackers:
        if self.enabled:
            self.accelerator.init_trackers(run_name, config=flat_config(cfg))
            self.started = True
        return self

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        if self.started:
            self.accelerator.log(
                {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm}, step=step
            )

    def log_eval(self, step: int, result: dict | None) -> None:
        if self.started and result:
            self.accelerator.log(eval_metrics(result), step=step)

    def end(self) -> None:
        """Closes W&B / MLflow runs (as failed, when the run failed) rather than leaving them open."""
        if self.started:
            self.accelerator.end_training()
