"""Third-party warnings that say nothing to the user, silenced where they arise; ``--verbose`` shows them.

Each entry names one logger or one warning by module and message, and says why it is noise: a
global "ignore all" would also hide the warnings that matter (a slow kernel path, a bad tokenizer).
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "KIT_VERBOSE"  # set by launch_training.sh --verbose, read by every process it starts

# logger name -> message prefix. bitsandbytes logs this on every CPU import when the optional `kernels`
# package is absent; its own CPU kernel runs instead, and nothing in the kit needs the faster one.
NOISY_LOGS = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    # liger-kernel (the CUDA fast path) probes optional CuTe-DSL and Ascend backends at the first kernel call
    # and logs each one it cannot import; its Triton kernels, the ones the fast path uses, run regardless.
    "liger_kernel.backends.registry": "Backend impl '%s' for op '%s' could not be imported",
}

# (message regex, category, module regex). peft reads `model.is_gradient_checkpointing`, which
# transformers 5 deprecates with a FutureWarning on every run; the kit never calls it.
NOISY_WARNINGS = [
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    # torch's autograd engine runs a GPU backward on a thread of its own; the first cuBLAS call there finds no
    # current CUDA context and sets the primary one, which is the context every other call uses anyway. Torch
    # warns once per process, from whichever module made that call (every GPU start printed it, session 29;
    # vLLM silences it too, vllm#25596).
    (r"Attempting to run cuBLAS, but there was no current CUDA context", UserWarning, r""),
]


class DropMessage(logging.Filter):
    """Drops a logger's records whose message starts with one prefix; keeps everything else."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def is_verbose(flag: bool = False) -> bool:
    return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def install(verbose: bool = False) -> None:
    """Install the filters above, before the libraries are imported; nothing when verbose."""
    if is_verbose(verbose):
        os.environ[VERBOSE_ENV] = "1"  # accelerate's and the sweep's child processes see it too
        return
    for name, prefix in NOISY_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(DropMessage(prefix))
    for message, category, module in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
