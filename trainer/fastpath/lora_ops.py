"""LoRA-aware autograd: the frozen base weight and the LoRA pair in one function, saving only what backward needs.

PEFT computes ``base(x) + B(A(dropout(x))) * s`` as separate modules: the LoRA branch writes a full
(tokens x out) tensor, scales it, adds it, and autograd keeps the pieces. Here the LoRA product is folded
into the base GEMM's output with one ``addmm_`` (scale in its ``alpha``), the backward accumulates the input
gradient the same way, and a 4-bit weight is dequantized into a buffer reused by every layer of that shape
instead of a fresh allocation per use. ``lora_mlp`` does the same for a gate/up/down SwiGLU block and keeps
only the block's input and the two pre-activation tensors: the activation product is recomputed in backward.
``lora_group`` runs several projections of one input (Q, K and V) as one node with one stacked A GEMM.

Maths (W: out x in, A: r x in, B: out x r, s: scale, x: N x in):
    y  = x W^T + s (x A^T) B^T
    dx = dy W + s (dy B) A,   dA = s (dy B)^T x,   dB = s dy^T (x A^T)

Every function here runs on CPU too (eager elementwise ops instead of Liger's Triton SwiGLU), which is how
the tests check them against PEFT's own forward and autograd in fp32.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from trainer.fastpath import recompute_tail


class BaseWeight:
    """The frozen weight of a projection: a plain tensor, or a bitsandbytes 4-bit parameter to dequantize."""

    __slots__ = ("weight", "bias", "quantized")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias
        self.quantized = getattr(weight, "quant_state", None) is not None

    def materialize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense (out x in) tensor of ``dtype``; 4-bit weights land in a shared buffer."""
        if not self.quantized:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        state = self.weight.quant_state
        if self.weight.device.type == "cuda":
            dense = dequantize_4bit_into(self.weight.data, state)
        else:  # bitsandbytes' CPU backend has no out= variant
            import bitsandbytes.functional as bnbf

            dense = bnbf.dequantize_4bit(self.weight.data, state)
        return dense if dense.dtype == dtype else dense.to(dtype)


def dequantize_4bit_into(packed: torch.Tensor, state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit`` as its two CUDA ops, into the shared buffer.

    The same kernels bitsandbytes' own function launches (absmax first when double-quantized), without
    its Python checks: a step dequantizes every weight three times (forward, recompute, backward), and
    the host time of those calls, not the kernels, is what bounds a QLoRA step on an H100."""
    ops = torch.ops.bitsandbytes
    absmax = state.absmax
    if state.nested:
        inner = state.state2
        absmax = ops.dequantize_blockwise.default(
            absmax, inner.absmax, inner.code, inner.blocksize, torch.float32
        )
        absmax += state.offset
    out = _dequant_buffer(tuple(state.shape), state.dtype, packed.device)
    ops.dequantize_4bit.out(
        packed, absmax, state.blocksize, state.quant_type, state.shape, state.dtype, out=out
    )
    return out


_BUFFERS: dict[tuple, torch.Tensor] = {}


def _dequant_buffer(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One buffer per (shape, dtype, device): layers run one after another on one stream, so they can share it.

    The dequantized weight is never saved for backward (backward dequantizes again), so reuse is safe.
    """
    key = (shape, dtype, str(device))
    buffer = _BUFFERS.get(key)
    if buffer is None:
        buffer = _BUFFERS[key] = torch.empty(shape, dtype=dtype, device=device)
    return buffer


_generation = 0  # bumped after every optimizer step (see track_updates)
_inline = False  # casts computed at each call, not cached (inside a CUDA graph: see inline_casts)
_cast_sources: list = []  # weak references to every parameter cast so far


def weights_updated(*_) -> None:
    """Every cached cast is stale: an optimizer stepped. Fused and bitsandbytes optimizers update parameters
    in place without bumping their version counters, so the version alone cannot tell."""
    global _generation
    _generation += 1


def track_updates(optimizer) -> None:
    """Mark the cast cache stale after each ``optimizer.step()`` (a post-step hook, also through accelerate)."""
    optimizer.register_step_post_hook(weights_updated)


def _fresh(param: torch.Tensor, dtype: torch.dtype) -> bool:
    cached = getattr(param, "_kit_cast", None)
    return cached is not None and cached[:3] == (_generation, param._version, dtype)


@contextlib.contextmanager
def inline_casts():
    """Casts computed where they are used, not taken from the cache: a CUDA graph records them as kernels and
    replays them after every optimizer step, where a cached copy recorded once would never change."""
    global _inline
    before, _inline = _inline, True
    try:
        yield
    finally:
        _inline = before


def cast(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``param`` in ``dtype``, cast once per optimizer step: the copy is kept until the parameter changes.

    fp32 LoRA weights would otherwise be cast at every forward, recompute and backward (six small kernels
    per projection per step). When one cached copy is found stale, every stale one of the same dtype and
    device is refreshed at once with one multi-tensor copy: after an optimizer step all of them are, and
    hundreds of single casts (a small model has ~400 LoRA tensors) cost more host time than GPU time.
    Fresh tensors each time (never written in place), so a copy saved for a backward is never changed."""
    if param.dtype == dtype:
        return param
    if _inline or not param.is_leaf:  # built at this call (LoRA-GA's concatenated pair): nothing to keep
        return param.to(dtype)
    if _fresh(param, dtype):
        return param._kit_cast[3]
    if getattr(param, "_kit_cast", None) is None:
        _cast_sources.append(weakref.ref(param))
    stale, alive = [param], []
    for ref in _cast_sources:
        other = ref()
        if other is None:
            continue
        alive.append(ref)
        if (
            other is not param and other.dtype == param.dtype and other.device == param.device
            and getattr(other, "_kit_cast", (None,) * 3)[2] == dtype and not _fresh(other, dtype)
        ):  # fmt: skip
            stale.append(other)
    _cast_sources[:] = alive
    copies = [torch.empty_like(t, dtype=dtype) for t in stale]
    with torch.no_grad():
        torch._foreach_copy_(copies, [t.detach() for t in stale])
    for t, copy in zip(stale, copies):
        t._kit_cast = (_generation, t._version, dtype, copy)
    return copies[0]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in: autocast's where it is on (as PEFT's modules would get), else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


BASE_GEMM_LAST = True  # the base GEMM accumulates onto the LoRA term (see low_rank_then_base)


def low_rank_then_base(
    out: torch.Tensor | None, low: torch.Tensor, up: torch.Tensor, scale: float, terms, bias=None
):
    """s * low @ up (+ bias), plus each (x, w) of ``terms`` as x @ w, written into ``out`` (or a new tensor).
    ``terms`` is iterated once, each w used before the next is made: 4-bit bases of one shape share one buffer.

    The rank-r product runs first, writing the output once, and each full GEMM then adds onto it in its
    epilogue (beta 1), where reading the output hides behind the GEMM's compute. The other order, a full GEMM
    and then the rank-r product added with ``addmm_``, reads and writes the whole output once more in a
    memory-bound pass: 128 MiB each way for Llama-1B's gate and up at 4 x 2048 tokens."""
    if out is None:
        out = low.new_empty(low.shape[0], up.shape[1])
    if not BASE_GEMM_LAST:
        terms = iter(terms)
        x, w = next(terms)
        torch.mm(x, w, out=out) if bias is None else torch.addmm(bias, x, w, out=out)
        for x, w in terms:
            out.addmm_(x, w)
        return out.addmm_(low, up, alpha=scale)
    if bias is None:
        out.addmm_(low, up, beta=0, alpha=scale)  # beta 0: out's old contents are ignored, NaN included
    else:
        torch.addmm(bias, low, up, alpha=scale, out=out)  # the bias in the same GEMM's epilogue
    for x, w in terms:
        out.addmm_(x, w)
    return out


def _forward(x2: torch.Tensor, base: BaseWeight, a: torch.Tensor, b: torch.Tensor, scale: float):
    """y = x W^T (+ bias) + s (x A^T) B^T; returns y and x A^T (kept for dB)."""
    w = base.materialize(x2.dtype)
    xa = torch.mm(x2, a.t())
    y = low_rank_then_base(None, xa, b.t(), scale, [(x2, w.t())], _bias(base, x2.dtype))
    return y, xa


def _bias(base: BaseWeight, dtype: torch.dtype) -> torch.Tensor | None:
    return None if base.bias is None else base.bias.to(dtype)


def _backward(dy: torch.Tensor, x2, xa, base: BaseWeight, a, b, scale: float, need_dx: bool, dx_into=None):
    """Gradients of one LoRA projection: dx (or None), dA, dB, all in the compute dtype.

    ``dx_into``: a buffer of dx's shape whose contents are not needed any more once dA is computed (``x2``
    itself, where the caller owns it): dx is written there instead of into a new tensor."""
    dyb = torch.mm(dy, b).mul_(scale)  # N x r
    grad_a = torch.mm(dyb.t(), x2)
    grad_b = torch.mm(dy.t(), xa * scale)
    grad_x = None
    if need_dx:
        grad_x = low_rank_then_base(dx_into, dyb, a, 1.0, [(dy, base.materialize(dy.dtype))])
    return grad_x, grad_a, grad_b


class LoraLinearFunction(torch.autograd.Function):
    """One LoRA projection (base frozen, possibly 4-bit) as a single autograd node."""

    @staticmethod
    def forward(ctx, x, a_weight, b_weight, base: BaseWeight, scale: float, dtype: torch.dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        a, b = cast(a_weight, dtype), cast(b_weight, dtype)
        y, xa = _forward(x2, base, a, b, scale)
        ctx.save_for_backward(x2, xa, a, b)
        ctx.base, ctx.scale, ctx.shape = base, scale, shape
        ctx.param_dtypes = (a_weight.dtype, b_weight.dtype)
        ctx.x_dtype = x.dtype
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, a, b = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(x2.dtype)
        grad_x, grad_a, grad_b = _backward(dy, x2, xa, ctx.base, a, b, ctx.scale, ctx.needs_input_grad[0])
        if grad_x is not None:
            grad_x = grad_x.view(ctx.shape).to(ctx.x_dtype)
        return grad_x, grad_a.to(ctx.param_dtypes[0]), grad_b.to(ctx.param_dtypes[1]), None, None, None


def lora_linear(x: torch.Tensor, a_weight, b_weight, base: BaseWeight, scale: float) -> torch.Tensor:
    return LoraLinearFunction.apply(x, a_weight, b_weight, base, scale, compute_dtype(x))


# ------------------------------------------------------------------ projections of one input (Q/K/V)


def _group_forward(x2: torch.Tensor, bases, a_list, b_list, scales):
    """Several LoRA projections of one input: one GEMM for all the A products (their weights stacked),
    then each base GEMM with its B product folded in. Returns the outputs and x A^T (N x sum of ranks)."""
    a_all = torch.cat(a_list) if len(a_list) > 1 else a_list[0]
    xa = torch.mm(x2, a_all.t())
    outs, start = [], 0
    for base, b, scale in zip(bases, b_list, scales):
        w = base.materialize(x2.dtype)
        rank = b.shape[1]
        y = low_rank_then_base(
            None, xa[:, start : start + rank], b.t(), scale, [(x2, w.t())], _bias(base, x2.dtype)
        )
        outs.append(y)
        start += rank
    return outs, xa, a_all


def _group_backward(dys, x2, xa, a_all, bases, b_list, scales, need_dx: bool):
    """dx (or None) and each projection's (dA, dB); the A gradients and dx's LoRA term in one GEMM each."""
    dyb = torch.cat([torch.mm(dy, b).mul_(scale) for dy, b, scale in zip(dys, b_list, scales)], dim=1)
    grad_a_all = torch.mm(dyb.t(), x2)
    grads, start = [], 0
    for dy, b, scale in zip(dys, b_list, scales):
        rank = b.shape[1]
        grads.append(
            (grad_a_all[start : start + rank], torch.mm(dy.t(), xa[:, start : start + rank] * scale))
        )
        start += rank
    grad_x = None
    if need_dx:
        terms = ((dy, base.materialize(dy.dtype)) for dy, base in zip(dys, bases))  # one at a time
        grad_x = low_rank_then_base(None, dyb, a_all, 1.0, terms)
    return grad_x, grads


class LoraGroupFunction(torch.autograd.Function):
    """Q, K and V (or any projections of one input) with LoRA as one autograd node: one A GEMM for all of
    them forward and backward, one node instead of three on the host's critical path."""

    @staticmethod
    def forward(ctx, x, bases, scales, dtype, *weights):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        lo = [cast(w, dtype) for w in weights]
        a_list, b_list = lo[0::2], lo[1::2]
        outs, xa, a_all = _group_forward(x2, bases, a_list, b_list, scales)
        ctx.save_for_backward(x2, xa, a_all, *b_list)
        ctx.bases, ctx.scales, ctx.shape, ctx.x_dtype = bases, scales, shape, x.dtype
        ctx.param_dtypes = tuple(w.dtype for w in weights)
        return tuple(y.view(*shape[:-1], y.shape[-1]) for y in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x2, xa, a_all, *b_list = ctx.saved_tensors
        dys = [
            torch.zeros(x2.shape[0], b.shape[0], dtype=x2.dtype, device=x2.device)
            if g is None
            else g.reshape(-1, g.shape[-1]).to(x2.dtype)
            for g, b in zip(grad_outs, b_list)
        ]
        need_dx = ctx.needs_input_grad[0]
        grad_x, grads = _group_backward(dys, x2, xa, a_all, ctx.bases, b_list, ctx.scales, need_dx)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.shape).to(ctx.x_dtype)
        flat = [g for pair in grads for g in pair]
        return (grad_x, None, None, None, *(g.to(dt) for g, dt in zip(flat, ctx.param_dtypes)))


def lora_group(x: torch.Tensor, *parts) -> tuple[torch.Tensor, ...]:
    """``parts``: (A weight, B weight, BaseWeight, scale) of each projection of ``x``; one output each."""
    weights = [w for part in parts for w in part[:2]]
    bases = tuple(part[2] for part in parts)
    scales = tuple(part[3] for part in parts)
    return LoraGroupFunction.apply(x, bases, scales, compute_dtype(x), *weights)


# ------------------------------------------------------------------ SwiGLU MLP


def _swiglu(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if e.is_cuda:
        from liger_kernel.ops.swiglu import swiglu_forward

        return swiglu_forward(e, g)[2]
    return F.silu(e) * g


def _swiglu_backward(e: torch.Tensor, g: torch.Tensor, dh: torch.Tensor):
    """(de, dg) of h = silu(e) * g; on CUDA Liger's kernel writes them over e and g (no new buffers)."""
    if e.is_cuda:
        from liger_kernel.ops.swiglu import swiglu_backward

        return swiglu_backward(e, g, dh)
    sig = torch.sigmoid(e)
    silu = e * sig
    return dh * g * (sig * (1 + e * (1 - sig))), dh * silu


def _mlp_backward(dy, x2, e, g, xa_gu, a_gu, ha_d, weights, bases, scales, need_dx: bool):
    """dx (or None) and the (dA, dB) pairs of gate, up and down, in the compute dtype, from the block's input
    ``x2``, its gate and up outputs ``e`` and ``g`` (written over) and their LoRA-A product ``xa_gu``.
    ``ha_d``: the activation's LoRA-A product for down, computed here where None."""
    gb, ub, da, db = weights
    h = _swiglu(e, g)  # recomputed: one (tokens x intermediate) tensor not kept between passes
    if ha_d is None:
        ha_d = torch.mm(h, da.t())
    # dh overwrites h, read for the last time by dA: one (tokens x intermediate) tensor fewer at the peak
    dh, grad_da, grad_db = _backward(dy, h, ha_d, bases[2], da, db, scales[2], True, dx_into=h)
    del h
    de, dg = _swiglu_backward(e, g, dh)
    del dh
    dx, ((grad_ga, grad_gb), (grad_ua, grad_ub)) = _group_backward(
        [de, dg], x2, xa_gu, a_gu, bases[:2], [gb, ub], scales[:2], need_dx
    )
    return dx, (grad_ga, grad_gb, grad_ua, grad_ub, grad_da, grad_db)


BLOCK_BYTES = 64 << 20  # a (tokens x intermediate) tensor of at least this many bytes: the block runs by rows
BLOCKS = 2  # ... in this many row blocks (see row_blocks)
FORWARD_BY_ROWS = True  # a forward without autograd (checkpointing's first pass) runs by rows too


def row_blocks(rows: int, intermediate: int, dtype: torch.dtype) -> list[slice] | None:
    """The row blocks an MLP block of ``rows`` tokens runs in where it may (None: whole).

    Only a large block: by rows, its (tokens x intermediate) tensors (gate and up outputs, the activation: 3 x
    128 MiB for Llama-1B at 4 x 2048) are a block's size, which lowers the CUDA graphs' pool (the peak of one
    layer's pass) at the cost of narrower GEMMs; where they are small they are not what the pool peaks at
    (bench/RESULTS.md, session 32: Llama-1B's LoRA + GC 3.74 -> 3.62 GiB at the same speed in two blocks, 3%
    slower in four; Qwen3-0.6B's 48 MiB blocks gained nothing and ran 7% slower). A 4-bit base dequantizes its
    weights again in every block."""
    if rows * intermediate * dtype.itemsize < BLOCK_BYTES:
        return None
    size = -(-rows // BLOCKS)
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def _blocks_for(x2: torch.Tensor, lo: list) -> list[slice] | None:
    return row_blocks(x2.shape[0], lo[1].shape[0], x2.dtype)


def _mlp_output_by_rows(x2, lo, bases, scales, blocks: list[slice]) -> torch.Tensor:
    """The block's output without autograd, a row block at a time (checkpointing's first pass)."""
    out = x2.new_empty(x2.shape[0], lo[5].shape[0])
    for rows in blocks:
        (e, g), _, _ = _group_forward(x2[rows], bases[:2], lo[0:3:2], lo[1:4:2], scales[:2])
        h = _swiglu(e, g)
        del e, g
        out[rows] = _forward(h, bases[2], lo[4], lo[5], scales[2])[0]
    return out


class LoraMLPFunction(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with LoRA on all three projections; saves x, gate(x), up(x) only.

    gate and up share their input, so they run as one group (one A GEMM each way).

    In a checkpointed layer's recompute whose MLP output nothing reads (``recompute_tail``) the down
    projection is not computed. Where the block is large (``row_blocks``) that forward saves only its input and
    computes nothing; the backward then runs the whole block, forward and backward, by blocks of rows: the
    recompute's forward is immediately followed by this backward, so the same GEMMs run, the activation once
    instead of twice, and no (tokens x intermediate) tensor exists whole. ``lora_mlp`` without autograd
    (checkpointing's first pass) runs a large block by rows too."""

    SKIPS_UNUSED_OUTPUT = True  # what ``recompute_tail`` looks for in a layer's autograd graph

    @staticmethod
    def forward(ctx, x, ga, gb, ua, ub, da, db, bases, scales, dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        lo = [cast(w, dtype) for w in (ga, gb, ua, ub, da, db)]
        ctx.bases, ctx.scales, ctx.shape, ctx.x_dtype = bases, scales, shape, x.dtype
        ctx.param_dtypes = tuple(w.dtype for w in (ga, gb, ua, ub, da, db))
        # in a checkpointed layer's recompute whose output nothing reads, only the saved tensors matter
        unused = recompute_tail.output_unused()
        ctx.blocks = _blocks_for(x2, lo) if unused else None
        if ctx.blocks is not None:  # the backward computes what it needs, by rows
            ctx.save_for_backward(x2, *lo)
            return x2.new_zeros(*shape[:-1], lo[5].shape[0])
        (e, g), xa_gu, a_gu = _group_forward(x2, bases[:2], lo[0:3:2], lo[1:4:2], scales[:2])
        h = _swiglu(e, g)
        if unused:
            ha_d = torch.mm(h, lo[4].t())
            out = h.new_zeros(h.shape[0], lo[5].shape[0])
        else:
            out, ha_d = _forward(h, bases[2], lo[4], lo[5], scales[2])
        del h
        ctx.save_for_backward(x2, e, g, xa_gu, a_gu, ha_d, lo[1], lo[3], lo[4], lo[5])
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        if ctx.blocks is not None:
            dx, grads = LoraMLPFunction._by_rows(ctx, dy, need_dx)
        else:
            x2, e, g, xa_gu, a_gu, ha_d, *weights = ctx.saved_tensors
            dy = dy.to(x2.dtype)
            dx, grads = _mlp_backward(
                dy, x2, e, g, xa_gu, a_gu, ha_d, weights, ctx.bases, ctx.scales, need_dx
            )
        if dx is not None:
            dx = dx.view(ctx.shape).to(ctx.x_dtype)
        grads = tuple(gr.to(dt) for gr, dt in zip(grads, ctx.param_dtypes))
        return (dx, *grads, None, None, None)

    @staticmethod
    def _by_rows(ctx, dy, need_dx: bool):
        """The block's forward and backward over row blocks; the weights' gradients summed in fp32."""
        x2, ga, gb, ua, ub, da, db = ctx.saved_tensors
        dy = dy.to(x2.dtype)
        bases, scales = ctx.bases, ctx.scales
        dx = torch.empty_like(x2) if need_dx else None
        sums = None
        for rows in ctx.blocks:
            xb = x2[rows]
            (e, g), xa_gu, a_gu = _group_forward(xb, bases[:2], [ga, ua], [gb, ub], scales[:2])
            dxb, grads = _mlp_backward(dy[rows], xb, e, g, xa_gu, a_gu, None, (gb, ub, da, db), bases, scales,
                                       need_dx)  # fmt: skip
            del e, g
            if dxb is not None:
                dx[rows] = dxb
            grads = [gr.float() for gr in grads]
            if sums is None:
                sums = grads
            else:
                torch._foreach_add_(sums, grads)
        return dx, sums


def lora_mlp(x, gate, up, down) -> torch.Tensor:
    """``gate``/``up``/``down``: (A weight, B weight, BaseWeight, scale) for each projection."""
    bases = (gate[2], up[2], down[2])
    scales = (gate[3], up[3], down[3])
    dtype = compute_dtype(x)
    if FORWARD_BY_ROWS and not torch.is_grad_enabled():  # no autograd (checkpointing's first pass, eval)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        lo = [cast(w, dtype) for w in (gate[0], gate[1], up[0], up[1], down[0], down[1])]
        blocks = _blocks_for(x2, lo)
        if blocks is not None:
            return _mlp_output_by_rows(x2, lo, bases, scales, blocks).view(*x.shape[:-1], lo[5].shape[0])
    return LoraMLPFunction.apply(x, gate[0], gate[1], up[0], up[1], down[0], down[1], bases, scales, dtype)
