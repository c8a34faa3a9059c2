"""CUDA graphs over each offloaded checkpointed decoder layer: one launch replays a layer's forward, one its
recompute and backward, where Python launched hundreds of kernels one by one.

Why: the fast path's checkpointed LoRA and QLoRA steps are host-bound (bench/RESULTS.md, issue 31): about as
much host time as GPU time per step, 0.02-0.2 ms of Python per launch, ~2.5k launches. With packed rows a
layer's inputs keep their shapes from one micro-batch to the next, so its kernels can be recorded once.

How (``LayerGraphs``, called by ``offload._OffloadedCheckpoint``):
- a layer's first ``warmup`` calls of a shape run eagerly (Triton autotuning, cuBLAS and bitsandbytes set up
  there), then its forward and, in the backward, its recompute with backward are each captured once;
- every layer shares one set of static tensors: the hidden states in, out (or their gradient, in backward),
  the gradient of the output, and the side inputs (mask, rotary tables), copied in when a batch brings others;
- the trainable parameters' gradients are added inside the backward graph into buffers that become their
  ``.grad``, which is what accumulation over micro-batches needs whatever zero_grad did to ``.grad``;
- LoRA weights are cast inside the graphs (``lora_ops.inline_casts``): the cast cache makes new tensors after
  each optimizer step, which a graph recorded earlier would never see.

What stays eager, as before: a layer with hooks or dropout (the recompute would draw other masks), a shape
other than the first one captured, and everything once a capture fails (the reason is kept in ``off``). Several
processes only where their gradients are averaged once after the step, and with ``performance.cuda_graphs: on``
(decided where the fast path is applied, ``graphs_unavailable``): DDP's gradient hooks would not see these;
there the backward graphs ask for the gradients of views of the parameters (``reading_views``). A capture that
fails after others drops those graphs and gives their pool back.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from trainer.fastpath import lora_ops, recompute_tail

PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class CudaGraphs:
    """The device side: ``capture(body)`` records ``body`` (it does not run it) into a graph with ``replay()``.

    All graphs share one memory pool: they never run at once, and each copies what it leaves behind into the
    shared static tensors, so the pool holds one layer's transient tensors, not one set per layer."""

    live: weakref.WeakSet = weakref.WeakSet()  # every pool of this process, for the peak memory it holds
    carried_peak = 0  # the allocator's peak as it stood before ``run_in_free_memory`` reset it

    def __init__(self) -> None:
        self.pool = None
        self.unseen_bytes = (
            0  # the pool's memory no live tensor holds: replays use it, the allocator's peak not
        )
        CudaGraphs.live.add(self)

    def capture(self, body):
        if self.pool is None:
            # The eager step before the first capture left its activations in the allocator's cache, where the
            # graphs' own pool cannot take them: hand them back, or the process holds both sets from now on.
            torch.cuda.empty_cache()
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (telemetry) neither breaks the capture nor fails itself
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()
        self.unseen_bytes = _unallocated_pool_bytes(self.pool)
        return graph

    def release(self) -> None:
        """Give back the pool once no graph of it will replay (a later capture failed): the graphs are gone,
        so its memory is only cached, and the run's peak stops counting it."""
        self.pool = None
        self.unseen_bytes = 0
        torch.cuda.empty_cache()

    def run_in_free_memory(self, compute) -> tuple:
        """``compute()``'s tensors, computed with this thread's allocations in the pool's free memory (what only
        the replays use), then copied out; plainly, copied, before the first capture.

        Safe because every graph of this pool leaves what it keeps in tensors allocated outside its transient
        memory (the shared statics, the gradient buffers): between replays nothing lives in the free part, and
        nothing allocated here outlives the call. The allocator counts the lent blocks as allocated although
        the pool's size (``unseen_bytes``) counts them already; so the peak before the call is carried and the
        allocator's peak is restarted after it, where only the copies are new."""
        route = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
        if self.pool is None or route is None:
            return tuple(t.clone() for t in compute())
        device = torch.cuda.current_device()
        CudaGraphs.carried_peak = max(CudaGraphs.carried_peak, torch.cuda.max_memory_allocated(device))
        reserved = torch.cuda.memory_reserved(device)
        route(device, self.pool)
        try:
            results = compute()
        finally:
            torch._C._cuda_endAllocateToPool(device, self.pool)
            torch._C._cuda_releasePool(device, self.pool)
        copies = tuple(t.clone() for t in results)
        del results
        torch.cuda.reset_peak_memory_stats(device)
        if torch.cuda.memory_reserved(device) != reserved:  # the pool grew to fit: more of it is unseen
            self.unseen_bytes = _unallocated_pool_bytes(self.pool)
        return copies

    @classmethod
    def take_allocated_peak(cls, device) -> int:
        """The allocator's peak since the last call, a peak ``run_in_free_memory`` carried included; restarts
        both."""
        peak = max(torch.cuda.max_memory_allocated(device), cls.carried_peak)
        torch.cuda.reset_peak_memory_stats(device)
        cls.carried_peak = 0
        return peak

    @classmethod
    def unseen_bytes_now(cls) -> int:
        """Device memory the graph pools hold that ``max_memory_allocated`` (the run's peak) does not count: the
        transient tensors of the captured calls, freed when capture ended and written again by every replay.
        The pools' tensors still alive after capture (static inputs and outputs, saved activations) are
        allocated, so the allocator counts them already."""
        return sum(graphs.unseen_bytes for graphs in cls.live)


def _unallocated_pool_bytes(pool) -> int:
    """The bytes of the caching allocator's segments of ``pool`` that no live tensor holds."""
    segments = torch.cuda.memory_snapshot()
    return sum(
        s["total_size"] - s["allocated_size"]
        for s in segments
        if tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )


@dataclass
class _Statics:
    hidden: torch.Tensor  # a layer's input, in forward and in the recompute
    out: torch.Tensor  # its output in forward; the gradient of its input in backward
    grad: torch.Tensor  # the gradient of its output
    side: list  # the other tensor inputs (mask, rotary tables, positions)
    sources: list = field(default_factory=list)  # the tensors last copied into ``side``


@dataclass
class _LayerCall:
    layer: torch.nn.Module
    func: object  # the layer's forward function, called as func(layer, hidden, *rest, **kwargs)
    spec: object  # pytree spec of (rest, kwargs)
    leaves: list  # their leaves: tensors and plain values
    signature: tuple

    def with_side(self, side: list):
        """The layer as a function of its hidden states alone, its tensor inputs taken from ``side``."""
        tensors = iter(side)
        leaves = [next(tensors) if isinstance(v, torch.Tensor) else v for v in self.leaves]
        rest, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return lambda hidden: self.func(self.layer, hidden, *rest, **kwargs)


def _plain(value):
    return value if isinstance(value, PLAIN) else ("object", id(value))


def layer_of(run) -> tuple:
    """(the layer, its forward as a function of (layer, hidden, ...)) from transformers' checkpointed call:
    ``partial(forward, layer, **kwargs)`` or ``partial(layer.forward, **kwargs)``; (None, None) otherwise."""
    if not isinstance(run, functools.partial):
        return None, None
    if len(run.args) == 1 and isinstance(run.args[0], torch.nn.Module):
        return run.args[0], run.func
    owner = getattr(run.func, "__self__", None)
    if not run.args and isinstance(owner, torch.nn.Module):
        return owner, run.func.__func__
    return None, None


def why_eager(layer: torch.nn.Module) -> str | None:
    """Why this layer cannot be replayed from a graph (None when it can)."""
    for name, module in layer.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            return f"hooks on {name or 'the layer'}"
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"dropout in {name}"
        if float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0:
            return f"attention dropout in {name}"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module hooks"
    return None


def _autocast(state: dict):
    """The recorded autocast state without its weight-cast cache: a graph must record every cast."""
    return torch.autocast(
        device_type=state["device_type"], dtype=state["dtype"], enabled=state["enabled"], cache_enabled=False
    )


class LayerGraphs:
    """The graphs of one model's checkpointed layers (see the module's docstring)."""

    def __init__(self, backend=None, warmup: int = 1, alias_params: bool | None = None) -> None:
        self.backend = backend or CudaGraphs()
        self.warmup = warmup
        self.alias_params = alias_params  # None: where several processes run (``reading_views``)
        self.statics: _Statics | None = None
        self.signature: tuple | None = None
        self.calls: dict = {}  # ((layer id, kind), signature) -> eager calls so far
        self.graphs: dict = {}  # (layer id, kind) -> a captured graph
        self.grads: dict = {}  # layer id -> (parameters, the buffers that are their .grad)
        self.eager_layers: dict = {}  # layer id -> why it stays eager
        self.off: str | None = None  # why nothing is captured any more
        self.on_change = None  # called as on_change(state, detail): "replaying" once they do, "off" with why

    @property
    def captured(self) -> int:
        return len(self.graphs)

    def lender(self):
        """Where the loss may put its transient tensors (``frozen_head_loss``): the pool's free memory once layers
        replay, else None."""
        if self.off is not None or not self.graphs:
            return None
        return getattr(self.backend, "run_in_free_memory", None)

    def plan(self, run, rest: tuple, kwargs: dict, hidden: torch.Tensor, autocast: dict) -> _LayerCall | None:
        """The call ``run(hidden, *rest, **kwargs)`` of transformers' checkpointing, when it can be graphed."""
        if self.off is not None:
            return None
        layer, func = layer_of(run)
        if layer is None:
            self._give_up(f"the checkpointed call is not a layer's forward ({run!r:.120})")
            return None
        if id(layer) not in self.eager_layers:
            self.eager_layers[id(layer)] = why_eager(layer)
        if self.eager_layers[id(layer)] is not None:
            return None
        leaves, spec = pytree.tree_flatten((rest, {**run.keywords, **kwargs}))
        tensors = tuple((tuple(v.shape), v.dtype, v.device) for v in leaves if isinstance(v, torch.Tensor))
        plain = tuple(_plain(v) for v in leaves if not isinstance(v, torch.Tensor))
        signature = (tuple(hidden.shape), hidden.dtype, hidden.device, str(spec), tensors, plain,
                     tuple(sorted(autocast.items())))  # fmt: skip
        if self.signature is not None and signature != self.signature:
            return None
        return _LayerCall(layer, func, spec, leaves, signature)

    # ------------------------------------------------------------ forward and backward

    def forward(self, call: _LayerCall, hidden: torch.Tensor, autocast: dict) -> torch.Tensor | None:
        """The layer's output from its forward graph, or None: run it eagerly this time."""
        if self.off is not None:  # a capture failed after this call was planned
            return None
        key = (id(call.layer), "forward")
        graph = self.graphs.get(key)
        if graph is None:
            if not self._warm(key, call.signature):
                return None
            statics = self._statics(call, hidden)
            run = call.with_side(statics.side)

            def body():
                with _autocast(autocast), lora_ops.inline_casts():
                    out = run(statics.hidden)
                    if not isinstance(out, torch.Tensor) or out.shape != statics.out.shape:
                        raise TypeError(f"the layer returned {type(out).__name__}, not its hidden states")
                    statics.out.copy_(out)

            graph = self._capture(key, body, call, hidden)
            if graph is None:
                return None
        self._load(call, hidden)
        graph.replay()
        return self.statics.out.clone()

    def backward(self, call: _LayerCall, hidden, grad_out, need_input_grad: bool, autocast: dict):
        """(True, the gradient of the layer's input or None) after replaying its recompute and backward, the
        parameters' gradients added to their ``.grad``; (False, None): do it eagerly this time."""
        if self.off is not None or grad_out.shape != hidden.shape or grad_out.dtype != hidden.dtype:
            return False, None
        key = (id(call.layer), "backward", need_input_grad)
        graph = self.graphs.get(key)
        if graph is None:
            if not need_input_grad and not any(p.requires_grad for p in call.layer.parameters()):
                return True, None  # nothing in this layer learns and nothing before it needs a gradient
            if not self._warm(key, call.signature):
                return False, None
            params, buffers = self._grad_buffers(call.layer)
            statics = self._statics(call, hidden)
            run = call.with_side(statics.side)

            alias = several_processes() if self.alias_params is None else self.alias_params

            def body():
                with torch.enable_grad(), _autocast(autocast), lora_ops.inline_casts():
                    h = statics.hidden.detach().requires_grad_(need_input_grad)
                    with (
                        reading_views(call.layer, params, alias) as read,
                        recompute_tail.skipping(call.layer),
                    ):
                        out = run(h)
                inputs = ([h] if need_input_grad else []) + read
                grads = list(torch.autograd.grad(out, inputs, statics.grad, allow_unused=True))
                if need_input_grad:
                    statics.out.copy_(grads.pop(0))
                pairs = [(b, g) for b, g in zip(buffers, grads) if g is not None]
                if pairs:
                    torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])

            graph = self._capture(key, body, call, hidden, grad_out)
            if graph is None:
                return False, None
        self._load(call, hidden, grad_out)
        adopt_grads(*self._grad_buffers(call.layer))
        graph.replay()
        return True, (self.statics.out.clone() if need_input_grad else None)

    # ------------------------------------------------------------ the pieces

    def _warm(self, key, signature: tuple) -> bool:
        """Whether this call may be captured: the first ``warmup`` calls of its shape run eagerly (a shape's
        first call tunes Triton's kernels for it, which a capture could not do)."""
        counted = (key, signature)
        self.calls[counted] = self.calls.get(counted, 0) + 1
        return self.calls[counted] > self.warmup

    def _statics(self, call: _LayerCall, hidden: torch.Tensor) -> _Statics:
        if self.statics is None:
            self.signature = call.signature
            side = [torch.empty_like(v) for v in call.leaves if isinstance(v, torch.Tensor)]
            self.statics = _Statics(torch.empty_like(hidden), torch.empty_like(hidden), torch.empty_like(hidden),
                                    side, [None] * len(side))  # fmt: skip
        return self.statics

    def _load(self, call: _LayerCall, hidden, grad_out=None) -> None:
        """This call's tensors into the static ones the graphs read (side inputs only when they changed)."""
        statics = self.statics
        statics.hidden.copy_(hidden)
        if grad_out is not None:
            statics.grad.copy_(grad_out)
        tensors = [v for v in call.leaves if isinstance(v, torch.Tensor)]
        for i, tensor in enumerate(tensors):
            if statics.sources[i] is not tensor:
                statics.side[i].copy_(tensor)
                statics.sources[i] = tensor

    def _capture(self, key, body, call: _LayerCall, hidden, grad_out=None):
        self._load(call, hidden, grad_out)
        try:
            graph = self.backend.capture(body)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the layers as they were: eager
            self._give_up(f"capturing layer {type(call.layer).__name__} failed: {type(exc).__name__}: {exc}")
            return None
        if not self.graphs:
            shape = "x".join(str(n) for n in hidden.shape)
            print(
                f"CUDA graphs: checkpointed layers replay from graphs now (hidden states {shape})", flush=True
            )
            if self.on_change is not None:
                self.on_change("replaying", f"hidden states {shape}")
        self.graphs[key] = graph
        return graph

    def _give_up(self, reason: str) -> None:
        self.off = reason
        had_graphs = bool(self.graphs)
        self.graphs.clear()
        self.statics = None
        if had_graphs and hasattr(self.backend, "release"):
            self.backend.release()  # the forward graphs captured before a failed backward one, say
        print(f"WARNING: CUDA graphs are off for this run's layers (they run eagerly): {reason}",
              file=sys.stderr, flush=True)  # fmt: skip
        if self.on_change is not None:
            self.on_change("off", reason)

    def _grad_buffers(self, layer: torch.nn.Module) -> tuple[list, list]:
        """The layer's trainable parameters and the buffers its backward graph adds their gradients into
        (made at its capture: a layer left eager holds none)."""
        entry = self.grads.get(id(layer))
        if entry is None:
            params = [p for p in layer.parameters() if p.requires_grad]
            entry = self.grads[id(layer)] = (params, [torch.zeros_like(p) for p in params])
        return entry

    def describe(self) -> dict:
        eager = sorted({why for why in self.eager_layers.values() if why})
        return {"graphs": self.captured, "eager_layers": eager, "off": self.off}


def several_processes() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )


@contextlib.contextmanager
def reading_views(layer: torch.nn.Module, params: list, alias: bool):
    """Within, ``layer`` reads views of its trainable ``params`` made here (yielded: the backward graph asks
    for the gradients with respect to them); without ``alias``, the parameters themselves.

    Why, under DDP: its reducer keeps every parameter's gradient accumulator alive from when it wrapped the
    model, and that node remembers the stream current then (the default one). Asked for gradients with respect
    to the parameters, the autograd engine makes that stream wait on the capturing one, which ends the capture
    ("operation would make the legacy stream depend on a capturing blocking stream", measured on 2x H200). A
    view made inside the capture belongs to the capturing stream, and its gradient is the parameter's."""
    if not alias:
        yield params
        return
    views = {id(p): p.view_as(p) for p in params}
    swapped = []
    for module in layer.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in views:
                swapped.append((module, name, param))
                module._parameters[name] = views[id(param)]
    try:
        yield [views[id(p)] for p in params]
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def adopt_grads(params: list, buffers: list) -> None:
    """Make a graph's gradient buffers the parameters' ``.grad``, keeping what was accumulated so far."""
    if all(p.grad is b for p, b in zip(params, buffers)):
        return
    zero = [b for p, b in zip(params, buffers) if p.grad is None]
    moved = [(b, p.grad) for p, b in zip(params, buffers) if p.grad is not None and p.grad is not b]
    if zero:
        torch._foreach_zero_(zero)
    if moved:
        torch._foreach_copy_([b for b, _ in moved], [g for _, g in moved])
    for p, b in zip(params, buffers):
        p.grad = b
