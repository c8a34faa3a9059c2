"""GLA's reference maths in PyTorch: fla's naive recurrence for the GLA op and fla's RMSNorm semantics.

The reference path trains through these (trainer/families/gla.py swaps them in), and the start-up
self-check compares fla's Triton kernels with them (trainer/families/gla_checks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gla(
    q,
    k,
    v,
    gk=None,
    g=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    state_v_first=False,
    cu_seqlens=None,
    **_,
):
    """Stands in for fla's chunk_gla / fused_chunk_gla / fused_recurrent_gla (same arguments).

    fla's reference takes a batch of equal-length rows; varlen input (``cu_seqlens``, batch 1) is
    split at the boundaries and right-padded into such a batch, so no state crosses a boundary. The
    padding (zero keys and values, zero log-decay) leaves each sequence's final state as it was.
    """
    from fla.ops.gla.naive import naive_recurrent_gla

    gate = gk if gk is not None else g
    if scale is not None and scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)  # the reference always scales by K**-0.5
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    if cu_seqlens is None:
        o, state = naive_recurrent_gla(q, k, v, gate, initial_state, output_final_state)
    else:
        bounds = cu_seqlens.tolist()
        spans = list(zip(bounds[:-1], bounds[1:]))
        width = max(end - start for start, end in spans)

        def rows(t):
            return torch.stack([F.pad(t[0, a:b], (0, 0, 0, 0, 0, width - (b - a))) for a, b in spans])

        o_rows, state = naive_recurrent_gla(
            *(rows(t) for t in (q, k, v, gate)), initial_state, output_final_state
        )
        o = torch.cat([o_rows[i, : b - a] for i, (a, b) in enumerate(spans)])[None]
    if state is not None and state_v_first:
        state = state.transpose(-1, -2)
    return o, state


def torch_rms_norm(module, x, residual=None, prenorm=False, residual_in_fp32=False):
    """fla's RMSNorm semantics (optional residual add, prenorm returns the sum too), in torch."""
    dtype = x.dtype
    if residual is not None:
        x = x.float() + residual.float() if residual_in_fp32 else x + residual
    summed = x
    y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + module.eps)
    if module.weight is not None:
        y = y * module.weight.float()
    if getattr(module, "bias", None) is not None:
        y = y + module.bias.float()
    y = y.to(dtype)
    return (y, summed) if prenorm else y
