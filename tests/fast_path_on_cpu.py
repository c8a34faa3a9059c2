"""Test-only entry point: ``python -m tests.fast_path_on_cpu <trainer args>`` runs the trainer with the CUDA
fast path's own autograd nodes (fused LoRA projections, Q/K/V groups, SwiGLU blocks) forced on a CPU.

Their maths runs on a CPU; Liger's Triton kernels do not, so here Liger's model patch is off, the self-check is
skipped (the fast path's tests check each kernel), and the fused loss runs ``CpuFusedLinearCrossEntropy`` (and
``cpu_flce_forward`` under the kit's own node for a frozen head, ``frozen_head_loss``): Liger's
contract on a CPU (the gradients of the hidden states and the head computed in forward, handed back in backward),
so the head's weight gets its gradient from outside the head's own forward, as on the GPU. This is how tests
run the fast path under FSDP2 on gloo processes (tests/training/test_fsdp.py).

With ``KIT_TEST_CPU_GRAPHS=1`` the decoder layers also take the CUDA-graph paths (layer_graphs when
checkpointed, stack_graphs when not), with the CPU stand-in of tests/fastpath/test_layer_graphs.py for the
device's capture and replay."""

from __future__ import annotations

import os
import sys

import torch

from tests.cpu_liger import cpu_flce_forward, cpu_fused_linear_cross_entropy
from trainer import fastpath
from trainer.cli import main

fastpath.unavailable_reason = lambda device: None
fastpath.selfcheck.run = lambda *args, **kwargs: ()
fastpath._apply_liger = lambda *args, **kwargs: False
fastpath._liger_flce = lambda: cpu_fused_linear_cross_entropy
fastpath._flce_forward = cpu_flce_forward
if os.environ.get("KIT_TEST_CPU_GRAPHS") == "1":
    from tests.fastpath.test_layer_graphs import ReplayOnCpu
    from trainer.fastpath import layer_graphs, stack_graphs

    decide_graphs = fastpath.graphs_unavailable
    # The real decision (processes, checkpointing, packing), as if on a GPU.
    fastpath.graphs_unavailable = lambda mode, device, *args, **kwargs: decide_graphs(
        mode, torch.device("cuda"), *args, **kwargs
    )
    layer_graphs.CudaGraphs = stack_graphs.CudaGraphs = ReplayOnCpu

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
