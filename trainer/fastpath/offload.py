"""Activation checkpointing that keeps each decoder layer's input in pinned host memory, not on the GPU.

Why: with checkpointing, what a step still holds per layer is the layer's input (B x T x hidden, 32 MB for
Llama-1B at 4 x 2048), for every layer until the backward reaches it; on a narrow model with a large
vocabulary that is most of the activation memory (Qwen3-0.6B: 28 x 16 MB). Unsloth copies these inputs
to the host during the forward and back during the backward; this does the same on the fast path:

- forward: the layer runs without building a graph (as checkpointing does) while its input is copied to
  pinned memory on a side stream, so the copy overlaps the layer's own compute;
- backward: the input comes back (prefetched on the side stream while the layer after it in backward
  order, i.e. before it in the model, was still computing), the layer is recomputed with autograd on and
  back-propagated, under the autocast state and RNG state the forward had.

On CPU the "host copy" is the tensor itself, so the maths (recompute, nested backward, RNG and autocast
replay) runs in the CPU tests against plain checkpointing.
"""

from __future__ import annotations

import functools
import weakref

import torch

from trainer.fastpath import recompute_tail
from trainer.fastpath.layer_graphs import layer_of

ATTRIBUTE = "_kit_offloaded_checkpoint"
# transformers' ``enable_input_require_grads`` (called by its checkpointing, by PEFT, and by the kit's loading:
# each call adds one) and PEFT's own fallback
REQUIRE_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


class _Slot:
    """One layer input on its way to the host and back.

    No ``record_stream``: a block freed while a side stream still reads it stays occupied until the allocator
    sees that stream's work done, and with the layers replayed from CUDA graphs the host runs a whole forward
    ahead of the device, so every layer's input stayed occupied at once (Llama-1B at 4 x 2048: 15 x 32 MiB,
    bench/memory_peak.py). Instead the input is held until the compute stream is ordered after its copy
    (``settle``), and a prefetched input is allocated on the compute stream, which waits for its copy: each
    block is then free for the next allocation the moment it is let go."""

    def __init__(self, hidden: torch.Tensor, stream) -> None:
        self.device = hidden.device
        self.stream = stream
        self.back = None  # the input on the GPU again (a prefetch), with the event that says it is there
        self.source = None  # the input itself, until the compute stream waits for its copy
        if stream is None:  # CPU: nothing to move
            self.host = hidden
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            self.host.copy_(hidden, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        self.source = hidden.detach()  # the storage, not the autograd graph that made it

    def settle(self) -> None:
        """Order the compute stream after the copy to the host and let the input go."""
        if self.source is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.source = None

    def prefetch(self) -> None:
        if self.stream is None or self.back is not None or self.source is not None:
            return
        current = torch.cuda.current_stream(self.device)
        tensor = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self.stream.wait_stream(current)  # the block's earlier users on the compute stream are done
        with torch.cuda.stream(self.stream):
            tensor.copy_(self.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.back = (tensor, event)

    def load(self) -> torch.Tensor:
        if self.stream is None:
            return self.host.detach()
        if self.source is not None:  # never left the device (the last layers): no copy back
            tensor = self.source
            self.settle()
            return tensor
        self.prefetch()
        tensor, event = self.back
        torch.cuda.current_stream(self.device).wait_event(event)
        self.back = None
        return tensor


class Offloader:
    """The layer inputs of one model in forward order, so each backward can prefetch the next one it needs.

    Slots are held weakly: a forward whose backward never ran (an OOM mid-step) leaves dead entries, which
    are pruned, not a growing queue of host buffers."""

    def __init__(self) -> None:
        self.slots: list[weakref.ref] = []
        self.streams: dict = {}

    def stream_for(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def push(self, hidden: torch.Tensor) -> _Slot:
        """Start ``hidden``'s copy to the host, and settle the inputs pushed before it: the compute stream waits
        for their copies before the next layer (each copy ran beside the layer just launched, which takes
        longer: Llama-1B at 4 x 2048, 32 MiB in ~0.7 ms against ~2 ms) and lets them go, so one layer input
        at most waits on the device for its copy, the one of the layer running."""
        slot = _Slot(hidden, self.stream_for(hidden.device))
        self.slots = [ref for ref in self.slots if ref() is not None]
        for ref in self.slots:
            earlier = ref()
            if earlier is not None:
                earlier.settle()
        self.slots.append(weakref.ref(slot))
        return slot

    def take(self, slot: _Slot) -> torch.Tensor:
        """``slot``'s input back on its device, and the copy of the one before it started."""
        live = [ref() for ref in self.slots]
        index = next((i for i, s in enumerate(live) if s is slot), None)
        if index is not None:
            earlier = next((s for s in reversed(live[:index]) if s is not None), None)
            self.slots = self.slots[:index]
            tensor = slot.load()
            if earlier is not None:
                earlier.prefetch()
            return tensor
        return slot.load()


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


class NotOneTensor(TypeError):
    """The layer returned something other than one tensor (a tuple with attention weights, say)."""


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offloader, anchor, hidden, graphs=None, call=None, layer=None):
        ctx.run, ctx.offloader, ctx.layer = run, offloader, layer  # layer: None where it is not known
        ctx.graphs, ctx.call = graphs, call  # a layer_graphs.LayerGraphs and this layer's call, when graphed
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.device.type == "cuda" else None
        out = graphs.forward(call, hidden, ctx.autocast) if call is not None else None
        if out is None:
            out = run(hidden)
        if not isinstance(out, torch.Tensor):
            raise NotOneTensor(type(out).__name__)
        ctx.slot = offloader.push(hidden)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden = ctx.offloader.take(ctx.slot)
        ctx.slot = None
        need_input_grad = ctx.needs_input_grad[3]
        if ctx.call is not None:
            done, grad = ctx.graphs.backward(ctx.call, hidden, grad_out, need_input_grad, ctx.autocast)
            if done:
                ctx.run = ctx.call = None
                return None, None, None, grad, None, None, None
        hidden = hidden.requires_grad_(True)
        devices = [hidden.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=hidden.device.type):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad(), torch.autocast(**ctx.autocast), recompute_tail.skipping(ctx.layer):
                out = ctx.run(hidden)
        recompute_tail.learn(ctx.layer, out)
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        ctx.run = ctx.call = ctx.layer = None
        return None, None, None, hidden.grad if need_input_grad else None, None, None, None


class OffloadedCheckpoint:
    """A ``_gradient_checkpointing_func`` for transformers' decoder layers (called as ``func(fn, hidden)``)."""

    def __init__(self, graphs=None) -> None:
        self.offloader = Offloader()
        self.graphs = graphs  # layer_graphs.LayerGraphs: each layer replayed from CUDA graphs; None: eager
        # Makes the layer's output require grad even where its input does not (the first layer's input under
        # a frozen embedding), so the backward that computes the LoRA gradients is always reached.
        self.anchor = torch.empty(0, requires_grad=True)
        self.plain = False

    def __call__(self, run, *args, **kwargs):
        if self.plain or not args or not isinstance(args[0], torch.Tensor):
            return self.checkpoint(run, *args, **kwargs)
        hidden, rest = args[0], args[1:]
        layer, _ = layer_of(run)
        call = None
        if self.graphs is not None:
            call = self.graphs.plan(run, rest, kwargs, hidden, _autocast_state(hidden.device.type))
        if (
            rest or kwargs
        ):  # the other inputs (masks, positions) are kept as they are: only the hidden states move
            run = functools.partial(_call_with, run, rest, kwargs)
        try:
            return _OffloadedCheckpoint.apply(
                run, self.offloader, self.anchor, hidden, self.graphs, call, layer
            )
        except NotOneTensor:
            # A layer whose output this cannot route (a tuple): PyTorch's own checkpointing from now on.
            self.plain = True
            return self.checkpoint(run, hidden)

    @staticmethod
    def checkpoint(run, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _call_with(run, rest, kwargs, hidden):
    return run(hidden, *rest, **kwargs)


def offload_checkpointed_layers(model, graphs=None) -> int:
    """Route every checkpointed decoder layer of ``model`` through one ``OffloadedCheckpoint``; returns how
    many. Layers transformers does not checkpoint (checkpointing off, or ``every_n_layers``) stay as they are.
    ``graphs``: a ``layer_graphs.LayerGraphs`` that replays each layer from CUDA graphs after its first call."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    func = OffloadedCheckpoint(graphs)
    count = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module._gradient_checkpointing_func = func
            count += 1
    if count:
        setattr(model, ATTRIBUTE, func)
        stop_embedding_output_grads(model)
    return count


def stop_embedding_output_grads(model) -> int:
    """Remove the forward hooks that make the input embedding's output require grad; returns how many (one
    per ``enable_input_require_grads`` call: three for a LoRA model).

    transformers installs them with checkpointing, for reentrant checkpointing (which passes no gradient
    through a layer whose input needs none). ``OffloadedCheckpoint`` needs no such input: its anchor
    reaches every layer's backward. Kept, the hook makes the frozen embedding's output a leaf that needs a
    gradient: the first layer computes a gradient for its input that nothing reads, and the output (32 MiB
    for Llama-1B at 4 x 2048) and that gradient stay on the device through the step, past the loss
    (bench/memory_peak.py, bench/RESULTS.md session 28)."""
    removed = 0
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "") in REQUIRE_GRAD_HOOKS:
                del module._forward_hooks[key]
                removed += 1
        own = module.__dict__  # the handles transformers keeps (PEFT's wrapper forwards reads: its own only)
        if "_require_grads_hooks" in own:
            own["_require_grads_hooks"] = []
        own.pop("_require_grads_hook", None)
    return removed
