"""Run the kit's gated ``chunk_bwd_dqkwg`` kernel in Triton's interpreter against eager PyTorch autograd, fp32.

Run as a script (``TRITON_INTERPRET=1`` must be set before triton decorates the kernel, so the test starts a
fresh process). Prints one JSON line of the largest differences, relative to each reference's largest value.

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

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402


def reference(q, k, v, g, h, dh, do, scale, bounds, chunk, state_v_first):
    """dq, dk, dg by autograd over the chunk equations above; ``bounds`` are each sequence's (start, end)."""
    q, k, g = (x.detach().clone().requires_grad_() for x in (q, k, g))
    total = 0.0
    index = 0
    for start, end in bounds:
        for c0 in range(start, end, chunk):
            c1 = min(c0 + chunk, end)
            state, dstate = h[index], dh[index]  # [heads, K, V] or [heads, V, K]
            if state_v_first:
                state, dstate = state.transpose(-1, -2), dstate.transpose(-1, -2)
            index += 1
            qc, kc, vc, gc, doc = (x[0, c0:c1].transpose(0, 1) for x in (q, k, v, g, do))  # heads first
            last = gc[:, -1:]
            mask = torch.ones(c1 - c0, c1 - c0).tril().bool()
            scores = (qc @ kc.transpose(-1, -2)) * torch.exp2(gc[:, :, None] - gc[:, None, :])
            out = scale * ((qc * torch.exp2(gc)[..., None]) @ state + scores.masked_fill(~mask, 0) @ vc)
            h_next = (
                torch.exp2(last)[..., None] * state
                + (kc * torch.exp2(last - gc)[..., None]).transpose(-1, -2) @ vc
            )
            total = total + (doc * out).sum() + (dstate * h_next).sum()
    total.backward()
    return q.grad, k.grad, g.grad / math.log(2)


def main() -> None:
    from trainer.families.fla_gated_dqk import gated_chunk_bwd_dqkwg

    torch.manual_seed(0)
    heads, K, V, chunk, scale = 2, 32, 16, 64, 0.7
    report = {}
    for name, lengths, state_v_first in (("batch", None, True), ("varlen", (70, 45, 64), False)):
        if lengths is None:  # two rows of 100 positions as a [2, 100] batch, run as two "sequences" of one
            batch, T = 2, 100
            bounds_per_row = [(0, T)]
        else:
            batch, T = 1, sum(lengths)
        q, k = torch.randn(batch, T, heads, K), torch.randn(batch, T, heads, K)
        v, do = torch.randn(batch, T, heads, V), torch.randn(batch, T, heads, V)
        g = torch.empty(batch, T, heads)
        if lengths is None:
            starts = [(0, T)]
        else:
            edges = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            starts = list(zip(edges[:-1], edges[1:]))
        for b in range(batch):
            for s, e in starts:
                for c0 in range(s, e, chunk):
                    c1 = min(c0 + chunk, e)
                    g[b, c0:c1] = (-torch.rand(c1 - c0, heads) * 0.4).cumsum(0)
        chunks = sum(math.ceil((e - s) / chunk) for s, e in starts)
        shape = (batch * chunks, heads, V, K) if state_v_first else (batch * chunks, heads, K, V)
        h, dh = torch.randn(shape), torch.randn(shape)
        cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        dq, dk, dw, dg = gated_chunk_bwd_dqkwg(
            q=q, k=k, v=v, do=do, h=h, dh=dh, g=g, scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu, chunk_size=chunk,
        )  # fmt: skip
        want = [[], [], []]
        for b in range(batch):
            per_chunk = chunks
            rows = slice(b * per_chunk, (b + 1) * per_chunk)
            got = reference(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], h[rows], dh[rows], do[b : b + 1],
                scale, bounds_per_row if lengths is None else starts, chunk, state_v_first,
            )  # fmt: skip
            for store, part in zip(want, got):
                store.append(part)
        want = [torch.cat(part) for part in want]
        report[name] = {
            label: float((mine - ref).abs().max() / ref.abs().max())
            for label, mine, ref in zip(("dq", "dk", "dg"), (dq, dk, dg), want)
        }
        report[name]["dw_is_none"] = dw is None
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
