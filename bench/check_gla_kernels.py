"""Are fla's GLA Triton kernels right on this GPU? Outputs and gradients against fla's fp32 recurrence.

Why: fla 0.6.0 refuses its *scalar*-gated chunk backward on Hopper with Triton >= 3.4, < 3.7.1 (fla
issue #640) but runs GLA's per-key-gated ``chunk_gla`` there unguarded, and the family benchmark saw
the whole model's LoRA gradients differ from the naive op by 25% in fp32. This checks the op alone:
random q, k, v and gates shaped like GLA's (``logsigmoid(x) / 16``), fp32 inputs, relative error
(||fast - ref|| / ||ref||) of o, dq, dk, dv, dg for ``chunk_gla`` and ``fused_recurrent_gla`` against
``naive_recurrent_gla``; then again in bf16. Run it twice, the second time with
``TRITON_F32_DEFAULT=ieee``: if the fp32 errors drop to ~1e-6, TF32 rounding explains them; if not,
the kernel is wrong on this card.

    python bench/check_gla_kernels.py --out $OUT/gla_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness  # noqa: E402


def relative_errors(fast: dict, ref: dict) -> dict:
    return {name: float((fast[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-30)) for name in ref}


def run(op, q, k, v, g, do) -> dict:
    """Output and input gradients of ``op`` (fla's GLA argument order), all as fp32."""
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g)]
    out = op(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(do.to(out.dtype))
    result = {"o": out.detach().float()}
    result.update({f"d{n}": t.grad.float() for n, t in zip("qkvg", inputs)})
    return result


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.gla.naive import naive_recurrent_gla

    from trainer.tools.hardware import package_versions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4, help="GLA-340M's")
    parser.add_argument("--key-dim", type=int, default=128, help="q and k per head (GLA-340M's)")
    parser.add_argument("--value-dim", type=int, default=256, help="v per head (GLA-340M's)")
    parser.add_argument("--out", default="gla_kernels.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (fla's Triton kernels)", file=sys.stderr)
        return 2

    gen = torch.Generator("cuda").manual_seed(0)
    shape = (args.batch, args.seq, args.heads)

    def randn(*dims):
        return torch.randn(*shape, *dims, device="cuda", generator=gen)

    q, k = randn(args.key_dim), randn(args.key_dim)
    v, do = randn(args.value_dim), randn(args.value_dim)
    g = F.logsigmoid(randn(args.key_dim)) / 16

    def naive(q, k, v, g):
        return naive_recurrent_gla(q, k, v, g)[0]

    ops = {
        "chunk_gla": lambda q, k, v, g: chunk_gla(q, k, v, g)[0],
        "fused_recurrent_gla": lambda q, k, v, g: fused_recurrent_gla(q, k, v, gk=g)[0],
    }
    reference = run(naive, q, k, v, g, do)  # fla computes it in fp32 whatever the input dtype
    env = {
        "device": torch.cuda.get_device_name(0),
        "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT", "(unset: tf32)"),
        **package_versions(("torch", "triton", "flash-linear-attention")),
    }
    print(json.dumps(env), flush=True)
    names = ["o", "dq", "dk", "dv", "dg"]
    print(
        f"{'op':22} {'dtype':9}"
        + "".join(f"{n:>10}" for n in names)
        + "   (relative error vs fp32 recurrence)"
    )
    rows = []
    # one line and one JSON rewrite per kernel: a run cut short (Triton compiles for minutes) keeps what it has
    for dtype in (torch.float32, torch.bfloat16):
        cast = [t.to(dtype) for t in (q, k, v, g)]
        for name, op in ops.items():
            row = {"op": name, "dtype": str(dtype).split(".")[1]}
            try:
                row.update(status="ok", **relative_errors(run(op, *cast, do), reference))
                print(f"{name:22} {row['dtype']:9}" + "".join(f"{row[n]:>10.2e}" for n in names), flush=True)
            except Exception as exc:  # noqa: BLE001 - a refused or failing kernel is a result too
                row["status"] = f"{type(exc).__name__}: {exc}"[:200]
                print(f"{name:22} {row['dtype']:9} {row['status']}", flush=True)
            rows.append(row)
            harness.write_json(args.out, {"environment": env, "shape": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
