"""Test-only entry point: ``python -m tests.fast_path_on_cpu <trainer args>`` runs the trainer with the CUDA
fast path's own autograd nodes (fused LoRA projections, Q/K/V groups, SwiGLU blocks) forced on a CPU.

Their maths runs on a CPU; Liger's Triton kernels and the fused loss do not, so here Liger's model patch is off,
the loss is the chunked cross-entropy and the self-check is skipped (the fast path's tests check each kernel).
This is how tests run the fast path under FSDP2 on gloo processes (tests/training/test_fsdp.py)."""

from __future__ import annotations

import sys

from trainer import fastpath
from trainer.cli import main
from trainer.model import chunked_loss

fastpath.unavailable_reason = lambda device: None
fastpath.selfcheck.run = lambda *args, **kwargs: ()
fastpath._apply_liger = lambda *args, **kwargs: False
fastpath.fused_cross_entropy = chunked_loss.chunked_cross_entropy

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
