"""``trainer.loop.train``: kept importable here; the loop and its parts live in ``trainer/training/``."""

from trainer.training.loop import train

__all__ = ["train"]
