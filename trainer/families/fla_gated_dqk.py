"""fla's gated ``chunk_bwd_dqkwg`` without the Hopper miscompile, registered as an fla backend.

The backward of a scalar-gated chunk scan (fla's ``chunk_simple_gla``, which is how the kit runs Mamba-2's SSD
scan) ends in ``chunk_bwd_dqkwg``. On Hopper with Triton >= 3.4, < 3.7.1 that kernel's
``tl.dot(tl.trans(b_ds), b_q)`` reads a transposed wgmma accumulator wrongly (fla #640; the fix proposed
upstream in fla PR #826 routes the transpose through memory), so fla refuses the gated case there. torch 2.11
and 2.12 pin such a Triton, so without this Mamba-2 falls back to the PyTorch reference path on an H100.

This is fla's kernel for that one case (a per-position log2 gate ``g``, no ``g_gamma``, no delta-rule ``w``),
with one change: ``ds^T`` is accumulated by its own ``tl.dot(b_v, tl.trans(b_do))`` instead of transposing the
accumulator of ``ds``. Same products, one more small [BT, BT] matmul per block. It is offered to fla through
its backend registry (``fla.backends.register``), so fla's own Triton kernel keeps every other case, and the
kit's start-up self-check, not this module, decides whether the path runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

BACKEND_NAME = "finetune_kit_gated_dqk"
_registered = False


@triton.jit(do_not_specialize=["T"])
def _gated_dqk_kernel(
    q,
    k,
    v,
    g,
    h,
    do,
    dh,
    dq,
    dk,
    dg,
    cu_seqlens,
    chunk_indices,
    scale,
    B: tl.constexpr,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NK: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_k, i_t = pid % NK, pid // NK
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HV, i_bh % HV

    every = B * T  # times the int64 i_k below: no 32-bit overflow
    if IS_VARLEN:
        i_tg = i_t
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
    else:
        NT = tl.cdiv(T, BT)
        i_tg = i_b * NT + i_t
        bos = i_b * T

    v += (bos * HV + i_h) * V
    do += (bos * HV + i_h) * V
    h += (i_tg * HV + i_h).to(tl.int64) * K * V
    dh += (i_tg * HV + i_h).to(tl.int64) * K * V
    q += (bos * H + i_h // (HV // H)) * K
    k += (bos * H + i_h // (HV // H)) * K
    dq += (bos * HV + i_h) * K
    dk += (bos * HV + i_h) * K
    dg += i_k * every * HV

    b_dg_last = tl.zeros([1], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_qk = m_t[:, None] & m_k[None, :]
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_hv = m_t[:, None] & m_v[None, :]
        p_v = v + o_t[:, None] * (HV * V) + o_v[None, :]
        p_do = do + o_t[:, None] * (HV * V) + o_v[None, :]
        if STATE_V_FIRST:
            p_h = h + o_v[:, None] * K + o_k[None, :]
            p_dh = dh + o_v[:, None] * K + o_k[None, :]
        else:
            p_h = h + o_v[:, None] + o_k[None, :] * V
            p_dh = dh + o_v[:, None] + o_k[None, :] * V
        m_h = m_v[:, None] & m_k[None, :]
        b_v = tl.load(p_v, mask=m_hv, other=0.0)
        b_do = tl.load(p_do, mask=m_hv, other=0.0)
        b_h = tl.load(p_h, mask=m_h, other=0.0)
        b_dh = tl.load(p_dh, mask=m_h, other=0.0)
        b_dg_last += tl.sum(b_h * b_dh)
        # ds = do v^T and, separately, ds^T = v do^T: the transpose is never taken of an accumulator.
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_dst = tl.dot(b_v, tl.trans(b_do), b_dst)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)

    tl.debug_barrier()
    b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)

    g += bos * HV + i_h
    dg += bos * HV + i_h
    b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0)
    b_g_last = tl.load(g + (tl.minimum(i_t * BT + BT, T) - 1) * HV)
    b_dg_last *= tl.exp2(b_g_last)
    b_dq = b_dq * tl.exp2(b_g)[:, None] * scale
    b_dk = b_dk * tl.where(m_t, tl.exp2(-b_g + b_g_last), 0)[:, None]
    b_dg_last += tl.sum(b_dk * b_k)

    m_a = (o_t[:, None] >= o_t[None, :]) & (m_t[:, None] & m_t[None, :])
    m_at = (o_t[None, :] >= o_t[:, None]) & (m_t[:, None] & m_t[None, :])
    b_ds = tl.where(m_a, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0) * scale
    b_dst = tl.where(m_at, b_dst * tl.exp2(b_g[None, :] - b_g[:, None]), 0) * scale
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
    b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)

    b_dg = tl.sum(b_dq * b_q, axis=1) - tl.sum(b_dk * b_k, axis=1)
    # fla runs the reverse cumsum of dg in a separate kernel; the chunk's last position carries dg_last.
    b_dg = tl.where(o_t < tl.minimum(i_t * BT + BT, T) - 1, b_dg, b_dg + b_dg_last)
    tl.store(dq + o_t[:, None] * (HV * K) + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_qk)
    tl.store(dk + o_t[:, None] * (HV * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_qk)
    tl.store(dg + o_t * HV, b_dg.to(dg.dtype.element_ty), mask=m_t)


def launch_config(K: int, V: int) -> dict:
    """Block sizes, warps and stages of the kernel for head sizes K, V (fixed: nothing to autotune at start-up)."""
    return {
        "BK": min(max(triton.next_power_of_2(K), 16), 64),
        "BV": min(max(triton.next_power_of_2(V), 16), 64),
        "num_warps": 4,
        "num_stages": 2,
    }


def gated_chunk_bwd_dqkwg(
    q,
    k,
    v,
    do,
    h,
    dh,
    w=None,
    g=None,
    g_gamma=None,
    dv=None,
    scale=None,
    state_v_first=False,
    cu_seqlens=None,
    chunk_size=64,
    chunk_indices=None,
):
    """fla's ``chunk_bwd_dqkwg`` (same arguments, same ``(dq, dk, dw, dg)``) for the gated case only."""
    import torch
    from fla.ops.utils import prepare_chunk_indices

    if g is None or g_gamma is not None or w is not None:
        raise ValueError("gated_chunk_bwd_dqkwg covers a per-position gate g only (no g_gamma, no w)")
    B, T, H, K, V, HV = *k.shape, v.shape[-1], v.shape[2]
    BT = chunk_size
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    launch = launch_config(K, V)
    BK, BV = launch["BK"], launch["BV"]
    NK = triton.cdiv(K, BK)
    if scale is None:
        scale = K**-0.5
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device)
    _gated_dqk_kernel[(NK * NT, B * HV)](
        q, k, v, g, h, do, dh, dq, dk, dg, cu_seqlens, chunk_indices, scale,
        B=B, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, NK=NK,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )  # fmt: skip
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, None, dg.sum(0)


def affected() -> bool:
    """Whether fla refuses its own gated kernel here: Hopper with Triton >= 3.4, < 3.7.1."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:  # noqa: BLE001 - another fla: its own kernels and the self-check decide
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def register() -> bool:
    """Offer ``gated_chunk_bwd_dqkwg`` to fla for the calls its guard refuses (process-wide, once); whether
    it is registered. Elsewhere fla's own kernel keeps every call."""
    global _registered
    if _registered:
        return True
    from fla import backends

    class GatedDqkBackend(backends.BaseBackend):
        backend_type = BACKEND_NAME
        priority = 1  # before fla's tilelang backend, which refuses simple GLA's fp32 states anyway

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs):
            bound = _bind(args, kwargs)
            if bound.get("g") is None or bound.get("g_gamma") is not None or bound.get("w") is not None:
                return False, "covers the gated case without g_gamma or w only"
            if not affected():
                return False, "fla's own kernel is right on this GPU and Triton"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return gated_chunk_bwd_dqkwg(**_bind(args, kwargs))

    backends.register("common")(GatedDqkBackend)
    _registered = True
    return True


_PARAMETERS = ("q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma", "dv", "scale", "state_v_first",
               "cu_seqlens", "chunk_size", "chunk_indices")  # fmt: skip


def _bind(args, kwargs) -> dict:
    """fla's positional and keyword arguments of ``chunk_bwd_dqkwg`` as one dict."""
    return {**dict(zip(_PARAMETERS, args)), **kwargs}
