"""Test-only entry point: ``python -m tests.fast_path_on_cpu <trainer args>`` runs the trainer with the CUDA
fast path's own autograd nodes (fused LoRA projections, Q/K/V groups, SwiGLU blocks) forced on a CPU.

Their maths runs on a CPU; Liger's Triton kernels and the fused loss do not, so here Liger's model patch is off,
the loss is the chunked cross-entropy and the self-check is skipped (the fast path's tests check each kernel).
This is how tests run the fast path under FSDP2 on gloo processes (tests/training/test_fsdp.py).

With ``KIT_TEST_CPU_GRAPHS=1`` the decoder layers also take the CUDA-graph paths (layer_graphs when
checkpointed, stack_graphs when not), with the CPU stand-in of tests/fastpath/test_layer_graphs.py for the
device's capture and replay."""

from __future__ import annotations

import os
import sys

from trainer import fastpath
from trainer.cli import main
from trainer.model import chunked_loss

fastpath.unavailable_reason = lambda device: None
fastpath.selfcheck.run = lambda *args, **kwargs: ()
fastpath._apply_liger = lambda *args, **kwargs: False
fastpath.fused_cross_entropy = chunked_loss.chunked_cross_entropy
if os.environ.get("KIT_TEST_CPU_GRAPHS") == "1":
    from tests.fastpath.test_layer_graphs import ReplayOnCpu
    from trainer.fastpath import layer_graphs, stack_graphs

    fastpath.graphs_unavailable = lambda mode, *args: (
        "performance.cuda_graphs: off" if mode == "off" else None
    )
    layer_graphs.CudaGraphs = stack_graphs.CudaGraphs = ReplayOnCpu

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
