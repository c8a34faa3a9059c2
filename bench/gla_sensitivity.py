"""How far apart can a GLA model's LoRA gradients be when only its GLA op is off by 1e-3? (CPU)

Why: on an H100, ``bench_families.py``'s fp32 check put the whole GLA-340M model's LoRA gradients through
fla's ``chunk_gla`` 24.8% away from the same model through fla's naive recurrence, while the op alone
(``check_gla_kernels.py``, same card) was only 1.2e-3 away (Triton's TF32 dots; ``fused_recurrent_gla``:
4e-7). This asks whether the model turns a 1e-3 op error into a 25% gradient difference by itself: it runs
the model on CPU through the naive op (the reference), then again with that op's output and input
gradients each perturbed by random noise of relative size ``--eps``, and reports the check's two figures
(largest logit difference, relative difference of all LoRA gradients). ``--eps 0`` with ``--fp64`` gives
fp32's own rounding against fp64.

    python bench/gla_sensitivity.py --eps 1.2e-3 --out /tmp/gla_sensitivity.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench import harness  # noqa: E402


def noisy(tensor, eps: float, gen):
    """``tensor`` with each element off by a relative ``eps`` (random sign and size): the shape of a rounding
    error (TF32 keeps 10 mantissa bits), whose norm-relative size is then ``eps`` as in check_gla_kernels."""
    import torch

    if eps == 0:
        return tensor
    return tensor * (1 + eps * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))


@contextlib.contextmanager
def perturbed_gla_op(eps: float, seed: int = 0):
    """fla's GLA layer calls its op through module globals; put a naive op there whose output (forward) and
    input gradients (backward) carry an error of relative size ``eps``, as the Triton kernel's do."""
    import torch
    from bench_families import gla_op_replaced

    from trainer.families.gla_reference import naive_gla

    gen = torch.Generator().manual_seed(seed)

    class OutputError(torch.autograd.Function):
        @staticmethod
        def forward(ctx, o):
            return noisy(o, eps, gen)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class GradientError(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return noisy(grad, eps, gen)

    def op(q, k, v, *args, **kwargs):
        q, k, v = (GradientError.apply(t) for t in (q, k, v))
        args = tuple(
            GradientError.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args
        )
        for gate in ("gk", "g"):
            if isinstance(kwargs.get(gate), torch.Tensor) and kwargs[gate].requires_grad:
                kwargs[gate] = GradientError.apply(kwargs[gate])
        o, state = naive_gla(q, k, v, *args, **kwargs)
        return OutputError.apply(o), state

    with gla_op_replaced(op):
        yield


def main(argv: list[str] | None = None) -> int:
    import torch
    from bench_families import GLA_340M, VOCAB, Row, kit_config, model_dir

    from trainer.model.loading import load_for_training

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1.2e-3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=GLA_340M["num_hidden_layers"])
    parser.add_argument("--lora-b-std", type=float, default=0.02, help="B as after some training (0: init)")
    parser.add_argument(
        "--fp64", action="store_true", help="the perturbed run in fp64 instead (eps 0: rounding)"
    )
    parser.add_argument("--out", default="gla_sensitivity.json")
    args = parser.parse_args(argv)

    folder = model_dir(Path(tempfile.mkdtemp()), {**GLA_340M, "num_hidden_layers": args.layers})
    row = Row("gla sensitivity", GLA_340M, "lora", "all-linear", 1)
    cfg = kit_config(folder, row, args.seq, smoke=True)  # fp32 weights
    torch.manual_seed(0)
    model = load_for_training(cfg, torch.device("cpu")).model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, args.lora_b_std)
    model.train()
    ids = torch.randint(3, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1))
    trainable = [p for p in model.parameters() if p.requires_grad]

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        grads = torch.cat([p.grad.flatten().double() for p in trainable if p.grad is not None])
        return logits.detach().double(), grads

    ref_logits, ref_grads = forward_backward()
    if args.fp64:
        model.double()
    with perturbed_gla_op(args.eps):
        logits, grads = forward_backward()
    result = {
        "eps": args.eps,
        "fp64": args.fp64,
        "layers": args.layers,
        "seq": args.seq,
        "lora_b_std": args.lora_b_std,
        "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
        "max_abs_logit": float(ref_logits.abs().max()),
        "grad_rel_diff": float((grads - ref_grads).norm() / ref_grads.norm()),
    }
    print(json.dumps(result), flush=True)
    harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
