"""The run folder's former module name, kept so ``from trainer import runlog`` (used across the
trainer, bench/ and tests) still works. Everything lives in ``trainer.runfolder``; new code
imports that. Nothing is defined here.
"""

from trainer.runfolder import *  # noqa: F403
from trainer.runfolder import __all__  # noqa: F401
