"""The kit's gated ``chunk_bwd_dqkwg`` kernel against eager PyTorch autograd (fp32), on a CPU or a GPU.

On a CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton decorates the
kernel, so the test starts a fresh process). On a GPU it also runs in bf16 and, with ``--fla``, runs fla's own
kernel on the same inputs with fla's guard lifted, to show what the guard is for. Prints one JSON line: per
case, the largest difference of dq, dk, dg relative to each reference's largest value.

The reference: within each chunk of a sequence, with the chunk's start state h and the gradient dh of its end
state held fixed, the scalar-gated chunk scan computes (g the chunk-local cumulative log2 gate)
    o      = scale * ((q * 2^g) h + (mask(q k^T * 2^(g_i - g_j))) v)
    h_next = 2^(g_last) h + (k * 2^(g_last - g))^T v
and the kernel's dq, dk, dg are the gradients of <do, o> + <dh, h_next> with respect to q, k and g (dg over
ln 2, since the kernel leaves that factor to fla's caller).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

CHUNK, SCALE, HEADS, K, V = 64, 0.7, 2, 32, 16


def reference(q, k, v, g, h, dh, do, bounds, state_v_first):
    """dq, dk, dg in fp32 by autograd over the chunk equations above; ``bounds``: (row, start, end) per sequence."""
    q, k, g = (x.detach().float().clone().requires_grad_() for x in (q, k, g))
    v, h, dh, do = (x.float() for x in (v, h, dh, do))
    total, index = 0.0, 0
    for row, start, end in bounds:
        for c0 in range(start, end, CHUNK):
            c1 = min(c0 + CHUNK, end)
            state, dstate = h[index], dh[index]  # [heads, K, V] or [heads, V, K]
            if state_v_first:
                state, dstate = state.transpose(-1, -2), dstate.transpose(-1, -2)
            index += 1
            qc, kc, vc, gc, doc = (x[row, c0:c1].transpose(0, 1) for x in (q, k, v, g, do))  # heads first
            last = gc[:, -1:]
            mask = torch.ones(c1 - c0, c1 - c0, device=q.device).tril().bool()
            scores = (qc @ kc.transpose(-1, -2)) * torch.exp2(gc[:, :, None] - gc[:, None, :])
            out = SCALE * ((qc * torch.exp2(gc)[..., None]) @ state + scores.masked_fill(~mask, 0) @ vc)
            decayed = (kc * torch.exp2(last - gc)[..., None]).transpose(-1, -2) @ vc
            h_next = torch.exp2(last)[..., None] * state + decayed
            total = total + (doc * out).sum() + (dstate * h_next).sum()
    total.backward()
    return q.grad, k.grad, g.grad / math.log(2)


def inputs(lengths, state_v_first, dtype, device):
    """A batch of two 100-position rows (``lengths`` None) or packed sequences in one row, with cu_seqlens."""
    batch, T = (2, 100) if lengths is None else (1, sum(lengths))
    edges = [0, T] if lengths is None else [0, *torch.tensor(lengths).cumsum(0).tolist()]
    bounds = [(row, s, e) for row in range(batch) for s, e in zip(edges[:-1], edges[1:])]
    q, k = torch.randn(batch, T, HEADS, K), torch.randn(batch, T, HEADS, K)
    v, do = torch.randn(batch, T, HEADS, V), torch.randn(batch, T, HEADS, V)
    g = torch.empty(batch, T, HEADS)
    for row, s, e in bounds:
        for c0 in range(s, e, CHUNK):
            c1 = min(c0 + CHUNK, e)
            g[row, c0:c1] = (-torch.rand(c1 - c0, HEADS) * 0.4).cumsum(0)
    chunks = sum(math.ceil((e - s) / CHUNK) for _, s, e in bounds)
    shape = (chunks, HEADS, V, K) if state_v_first else (chunks, HEADS, K, V)
    h, dh = torch.randn(shape), torch.randn(shape)
    cu = None if lengths is None else torch.tensor(edges)
    move = lambda x, d=dtype: None if x is None else x.to(device, d)  # noqa: E731
    tensors = dict(q=move(q), k=move(k), v=move(v), do=move(do), g=move(g, torch.float32))
    tensors.update(h=move(h, torch.float32), dh=move(dh, torch.float32), cu_seqlens=move(cu, torch.long))
    return tensors, bounds


def run(kernel, lengths, state_v_first, dtype, device) -> dict:
    tensors, bounds = inputs(lengths, state_v_first, dtype, device)
    dq, dk, dw, dg = kernel(**tensors, scale=SCALE, state_v_first=state_v_first, chunk_size=CHUNK)
    want = reference(*(tensors[n] for n in ("q", "k", "v", "g", "h", "dh", "do")), bounds, state_v_first)
    report = {
        label: float((mine.float() - ref).abs().max() / ref.abs().max())
        for label, mine, ref in zip(("dq", "dk", "dg"), (dq, dk, dg), want)
    }
    report["dw_is_none"] = dw is None
    return report


def main() -> None:
    from trainer.families.fla_gated_dqk import gated_chunk_bwd_dqkwg

    global K, V
    if "--kv" in sys.argv:  # other head sizes, e.g. --kv 16,32 (a Mamba-2 state of 16, head_dim 32)
        K, V = map(int, sys.argv[sys.argv.index("--kv") + 1].split(","))
    cuda = torch.cuda.is_available()
    if not cuda:
        assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run with TRITON_INTERPRET=1"
    device = "cuda" if cuda else "cpu"
    kernels = {"kit": gated_chunk_bwd_dqkwg}
    if cuda and "--fla" in sys.argv:
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # lift fla's guard: its own kernel, for comparison only
        kernels["fla"] = fla_chunk_o.chunk_bwd_dqkwg
    dtypes = (torch.float32, torch.bfloat16) if cuda else (torch.float32,)
    report = {}
    for name, kernel in kernels.items():
        for dtype in dtypes:
            for case, lengths, state_v_first in (("batch", None, True), ("varlen", (70, 45, 64), False)):
                torch.manual_seed(0)
                label = f"{name}-{str(dtype).split('.')[-1]}-{case}"
                try:
                    report[label] = run(kernel, lengths, state_v_first, dtype, device)
                except Exception as exc:  # noqa: BLE001 - report it; the other cases still run
                    report[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
