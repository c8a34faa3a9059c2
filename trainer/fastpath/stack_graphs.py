"""CUDA graphs over a model's decoder layers when they are not checkpointed: every layer's forward is one
replay, and so is its backward.

Why: without checkpointing the host launches each layer's kernels one by one in forward and backward, and for
models built of many small Triton kernels (GLA: ~4.5k launches per step, 143 ms of GPU work in a 290 ms step,
bench/RESULTS.md) or short LoRA steps the GPU waits on Python. ``layer_graphs`` covers checkpointed layers;
this covers the rest.

How (``StackGraphs``): each layer's ``forward`` goes through ``_call``.
- The first training forward of a shape runs eagerly (Triton autotuning, cuBLAS set-up) and records how each
  layer was called. At the second, before layer 0 runs, all layers are captured at once, in the order they
  replay: forward 0 .. N-1, then backward N-1 .. 0, in one memory pool. A layer's saved tensors live in the
  pool from its forward replay to its backward replay, and a later graph reuses them only after that, which
  is why the order is fixed (``torch.cuda.make_graphed_callables`` captures the same way; it is not used
  because its parameter gradients go through autograd as one buffer per parameter, which micro-batches
  accumulating into ``.grad`` would overwrite).
- Static tensors chain the layers: layer i's output graph writes layer i+1's input, and one gradient buffer
  carries the gradient down the stack, so a replayed layer hands the next one its tensor with no copy.
- Parameter gradients are added inside the backward graphs into buffers that become ``.grad``
  (``layer_graphs.adopt_grads``), so accumulation over micro-batches is a sum whatever zero_grad did. With
  several processes the forward graphs run each layer on views of its parameters made inside the capture, and
  the backward graphs ask for the views' gradients (``layer_graphs.reading_views``: DDP's retained gradient
  accumulators would end the capture).

Eager, as the model was: evaluation and no-grad forwards, a call the family marks unsafe (``eager_call``: GLA's
varlen rows, whose chunk layout fla reads on the host; frequent, so run as they are), and everything once a
capture fails or a layer has hooks or dropout (``off`` says why). A training call after the capture whose
shapes, mask or plain arguments differ from the captured ones (a batch of packed documents among plain rows, an
odd shape) runs eagerly under activation checkpointing: the graphs' pool holds the replays' activations all the
while, and a whole second set beside it was 8.8 GiB more for Llama-1B at 4 x 2048 (bench/RESULTS.md,
sessions 23-24); checkpointed, the step keeps one input per layer and recomputes each layer in backward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from trainer.fastpath import lora_ops
from trainer.fastpath.layer_graphs import (
    CudaGraphs,
    _autocast,
    _plain,
    adopt_grads,
    reading_views,
    several_processes,
    why_eager,
)


@dataclass
class _Call:
    """How the model called one layer: its other arguments as pytree leaves (tensors are the side inputs)."""

    spec: object
    leaves: list
    signature: tuple
    out_spec: object = None  # the layer's output structure; its first leaf is the hidden states

    @property
    def side(self) -> list:
        return [v for v in self.leaves if isinstance(v, torch.Tensor)]


def _autocast_now(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
    }


class _Replayed(torch.autograd.Function):
    """One layer as its two graphs: forward replays the forward graph, backward the backward graph."""

    @staticmethod
    def forward(ctx, stack, index, anchor, hidden):
        ctx.stack, ctx.index = stack, index
        return stack.replay_forward(index, hidden)

    @staticmethod
    def backward(ctx, grad_out):
        return None, None, None, ctx.stack.replay_backward(ctx.index, grad_out)


class StackGraphs:
    """The graphs of one model's decoder layers (see the module's docstring)."""

    def __init__(self, layers, backend=None, warmup: int = 1, eager_call=None, alias_params=None) -> None:
        self.layers = list(layers)
        self.backend = backend or CudaGraphs()
        self.warmup = warmup
        self.alias_params = alias_params  # None: where several processes run (``layer_graphs.reading_views``)
        self.reads: list = []  # per layer: what its backward graph asks gradients of (parameters, or views)
        self.eager_call = eager_call  # kwargs -> True where the family says this call cannot be recorded
        self.forwards = {}  # layer-0 signature -> eager training forwards seen
        self.recorded: list[_Call | None] = [None] * len(self.layers)
        self.signature = None  # the captured one
        self.fwd: list = []
        self.bwd: list = []
        self.ins: list = []  # ins[i]: layer i's input; ins[i + 1]: its output
        self.grad: torch.Tensor | None = None  # the gradient of the output of the layer being replayed
        self.grads: list = []  # per layer: (trainable parameters, the buffers that become their .grad)
        self.need_input_grad = False
        self.side: list = []
        self.sources: list = []
        self.replaying = False  # this forward's layers replay (decided at layer 0)
        self.off: str | None = None
        self.on_change = None  # called as on_change(state, detail): "replaying" once they do, "off" with why
        self._originals = []
        # Makes a layer's output require grad where its input does not (the first layer's, under a frozen
        # embedding), so the backward that adds the LoRA gradients is reached.
        self.anchor = torch.empty(0, requires_grad=True)

    # ------------------------------------------------------------ installing

    def install(self) -> int:
        """Route every layer's forward through the graphs; returns how many layers (0: left as they were)."""
        why = next((why for why in map(why_eager, self.layers) if why), None)
        if why:
            self.off = f"a layer stays eager: {why}"
            return 0
        for index, layer in enumerate(self.layers):
            original = layer.forward
            self._originals.append(original)
            layer.forward = lambda *args, _i=index, _f=original, **kwargs: self._call(_i, _f, *args, **kwargs)
        return len(self.layers)

    def _call(self, index: int, original, hidden, *args, **kwargs):
        layer = self.layers[index]
        if self.off is not None or not (layer.training and torch.is_grad_enabled()):
            return original(hidden, *args, **kwargs)
        call = self._describe(hidden, args, kwargs)
        if index == 0:
            self.replaying = self._ready(call, hidden)
        if self.replaying and call.signature == self.signature and self._same_side(call):
            new = _Replayed.apply(self, index, self.anchor, hidden)
            leaves, spec = self.recorded[index].out_spec
            return pytree.tree_unflatten([new, *leaves[1:]], spec)
        if self.signature is not None and call.signature[0] != "eager":
            # Captured, and this training call cannot replay (another shape or mask: an epoch's odd batch).
            # Checkpointed, it keeps one input per layer instead of a whole set of activations beside the pool.
            return checkpoint(original, hidden, *args, use_reentrant=False, **kwargs)
        out = original(hidden, *args, **kwargs)
        if self.signature is None:  # the calls the capture will follow: the last eager forward's
            self.recorded[index] = call
            self._note_output(index, out)
        return out

    def _describe(self, hidden, args: tuple, kwargs: dict) -> _Call:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = tuple(
            (tuple(v.shape), v.dtype, v.requires_grad) for v in leaves if isinstance(v, torch.Tensor)
        )
        plain = tuple(_plain(v) for v in leaves if not isinstance(v, torch.Tensor))
        signature = (tuple(hidden.shape), hidden.dtype, hidden.device, str(spec), tensors,
                     plain, tuple(sorted(_autocast_now(hidden.device.type).items())))  # fmt: skip
        if self.eager_call is not None and self.eager_call(kwargs):
            signature = ("eager", signature)
        return _Call(spec, leaves, signature)

    def _note_output(self, index: int, out) -> None:
        """Keep the layer's output structure; a layer returning other tensors beside its hidden states (router
        logits, attention weights) cannot be replayed."""
        leaves, spec = pytree.tree_flatten(out)
        if (
            not leaves
            or not isinstance(leaves[0], torch.Tensor)
            or any(isinstance(v, torch.Tensor) for v in leaves[1:])
        ):
            self._give_up(
                f"layer {index} returns {type(out).__name__} with other tensors than its hidden states"
            )
            return
        self.recorded[index].out_spec = ([None, *leaves[1:]], spec)

    def _same_side(self, call: _Call) -> bool:
        """Every layer reads the same side tensors (mask, rotary tables) as layer 0 did in this forward."""
        side = call.side
        return len(side) == len(self.sources) and all(a is b for a, b in zip(side, self.sources))

    # ------------------------------------------------------------ deciding and capturing

    def _ready(self, call: _Call, hidden) -> bool:
        """At layer 0: whether this forward replays (capturing all layers first, the first time)."""
        if call.signature[0] == "eager":
            return False
        if self.signature is None:
            seen = self.forwards[call.signature] = self.forwards.get(call.signature, 0) + 1
            if seen <= self.warmup or not self._recorded_like(call):
                return False
            self._build(call, hidden)
            if self.off is not None:
                return False
        if call.signature != self.signature or hidden.requires_grad != self.need_input_grad:
            return False
        self._load_side(call)
        return True

    def _recorded_like(self, call: _Call) -> bool:
        """The last eager forward called every layer as layer 0 is called now, with layer 0's side tensors
        (masks and rotary tables shared by all layers), and each returned its hidden states."""
        first = self.recorded[0]
        return all(
            r is not None
            and r.signature == call.signature
            and r.out_spec is not None
            and all(a is b for a, b in zip(r.side, first.side))
            for r in self.recorded
        )

    def _load_side(self, call: _Call) -> None:
        side = call.side
        for i, tensor in enumerate(side):
            if self.sources[i] is not tensor:
                self.side[i].copy_(tensor)
                self.sources[i] = tensor

    def _build(self, call: _Call, hidden) -> None:
        """Capture every layer's forward, then every backward in reverse (see the module's docstring)."""
        self.signature = call.signature
        self.need_input_grad = hidden.requires_grad
        self.side = [torch.empty_like(v) for v in call.side]
        self.sources = [None] * len(self.side)
        self._load_side(call)
        self.ins = [torch.empty_like(hidden).requires_grad_(self.need_input_grad)]
        self.ins += [torch.empty_like(hidden).requires_grad_(True) for _ in self.layers]
        self.grad = torch.empty_like(hidden)
        self.grads = [self._grad_buffers(layer) for layer in self.layers]
        autocast = {**_autocast_now(hidden.device.type)}
        self.reads = [params for params, _ in self.grads]
        held: list = [None] * len(
            self.layers
        )  # each forward graph's output, whose autograd graph backward reads
        try:
            self.fwd = [
                self.backend.capture(self._forward_body(i, held, autocast)) for i in range(len(self.layers))
            ]
            self.bwd = [None] * len(self.layers)
            for i in reversed(range(len(self.layers))):
                self.bwd[i] = self.backend.capture(self._backward_body(i, held))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the layers as they were: eager
            self._give_up(f"capturing the layers failed: {type(exc).__name__}: {exc}")
            return
        shape = "x".join(str(n) for n in hidden.shape)
        print(
            f"CUDA graphs: {len(self.layers)} layers replay from graphs now (hidden states {shape})",
            flush=True,
        )
        if self.on_change is not None:
            self.on_change("replaying", f"{len(self.layers)} layers, hidden states {shape}")

    def _forward_body(self, i: int, held: list, autocast: dict):
        recorded = self.recorded[i]
        original = self._originals[i]
        alias = several_processes() if self.alias_params is None else self.alias_params

        def body():
            side = iter(self.side)
            leaves = [next(side) if isinstance(v, torch.Tensor) else v for v in recorded.leaves]
            args, kwargs = pytree.tree_unflatten(leaves, recorded.spec)
            with torch.enable_grad(), _autocast(autocast), lora_ops.inline_casts():
                with reading_views(self.layers[i], self.grads[i][0], alias) as read:
                    out = pytree.tree_leaves(original(self.ins[i], *args, **kwargs))[0]
            self.reads[i] = read
            with torch.no_grad():
                self.ins[i + 1].copy_(out)
            held[i] = out

        return body

    def _backward_body(self, i: int, held: list):
        buffers = self.grads[i][1]
        need_input_grad = i > 0 or self.need_input_grad

        def body():
            inputs = ([self.ins[i]] if need_input_grad else []) + self.reads[i]
            with lora_ops.inline_casts():
                grads = list(torch.autograd.grad(held[i], inputs, self.grad, allow_unused=True))
            held[i] = None  # its saved tensors are free for the next graph, as they will be at replay
            if need_input_grad:
                self.grad.copy_(grads.pop(0))
            pairs = [(b, g) for b, g in zip(buffers, grads) if g is not None]
            if pairs:
                torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])

        return body

    def _grad_buffers(self, layer) -> tuple[list, list]:
        params = [p for p in layer.parameters() if p.requires_grad]
        return params, [torch.zeros_like(p) for p in params]

    # ------------------------------------------------------------ replaying

    def replay_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        static = self.ins[index]
        if hidden.data_ptr() != static.data_ptr():
            static.detach().copy_(hidden)
        self.fwd[index].replay()
        return self.ins[index + 1].detach()

    def replay_backward(self, index: int, grad_out: torch.Tensor):
        if grad_out.data_ptr() != self.grad.data_ptr():
            self.grad.copy_(grad_out)
        adopt_grads(*self.grads[index])
        self.bwd[index].replay()
        return self.grad.detach() if (index > 0 or self.need_input_grad) else None

    def _give_up(self, reason: str) -> None:
        self.off = reason
        self.fwd, self.bwd, self.ins, self.grads, self.grad, self.reads = [], [], [], [], None, []
        self.replaying = False
        if hasattr(self.backend, "release"):
            self.backend.release()  # graphs captured before the one that failed are never replayed
        print(f"WARNING: CUDA graphs are off for this run's layers (they run eagerly): {reason}",
              file=sys.stderr, flush=True)  # fmt: skip
        if self.on_change is not None:
            self.on_change("off", reason)

    def describe(self) -> dict:
        return {"graphs": len(self.fwd) + len([g for g in self.bwd if g is not None]), "off": self.off}
