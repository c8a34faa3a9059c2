"""The CUDA fast path for causal LMs: fused kernels, LoRA-aware autograd and a loss that never builds logits.

The loop takes it by itself on CUDA (``performance.fast_path: auto``); CPU runs, other families and
anything it cannot handle keep the reference path, which stays the one it is tested against.

What it does to a loaded (PEFT-wrapped) model, each piece only where it applies:
- Liger's RMSNorm, RoPE and SwiGLU kernels for the model types Liger knows (``liger_kernel``);
- every plain-LoRA projection as one autograd node, 4-bit bases dequantized into a reused buffer
  (``lora_ops``, ``patch``), Q/K/V of an attention block as one node, and gate/up/down SwiGLU blocks as
  one node that recomputes the activation;
- 4-bit MoE experts dequantized once per layer and multiplied by one grouped GEMM per projection
  (``moe_experts``) instead of transformers' per-expert loop;
- the next-token loss through Liger's fused linear cross-entropy (the head and the loss in chunks, the
  gradient computed in the forward), where the logits are exactly ``lm_head(hidden)``;
- with checkpointing, each decoder layer's input kept in pinned host memory until its backward (``offload``),
  and in one process the layer replayed from CUDA graphs (``layer_graphs``); without checkpointing, in one
  process, every decoder layer's forward and backward replayed from CUDA graphs (``stack_graphs``);
- for QLoRA, no fp32 upcast of norms and embeddings (``prepare_model_for_kbit_training`` does that for
  the reference path; it costs memory and bandwidth and the kernels compute in fp32 inside anyway).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from trainer.data.batches import to_device
from trainer.data.dataset import IGNORE
from trainer.families import ModelLoadError
from trainer.families import head as model_head
from trainer.fastpath import frozen_head_loss, selfcheck
from trainer.fastpath.layer_graphs import LayerGraphs
from trainer.fastpath.moe_experts import patch_quantized_experts
from trainer.fastpath.offload import ATTRIBUTE as OFFLOAD_ATTRIBUTE
from trainer.fastpath.offload import offload_checkpointed_layers
from trainer.fastpath.patch import lora_module_count, patch_lora_linears, patch_qkv_groups, patch_swiglu_mlps
from trainer.fastpath.stack_graphs import StackGraphs

ENABLED_ATTRIBUTE = "_kit_fast_path"
STACK_ATTRIBUTE = "_kit_stack_graphs"
MODES = ("auto", "on", "off")


class FastPathUnavailable(ModelLoadError):
    """``performance.fast_path: on`` was asked for where it cannot run."""


@dataclass
class FastPathReport:
    enabled: bool
    reason: str = ""
    liger_kernels: bool = False
    fused_loss: bool = False
    lora_modules_fused: int = 0
    lora_modules_reference: int = 0
    mlp_blocks_fused: int = 0
    qkv_groups_fused: int = 0
    rms_norm: str = "torch"
    offloaded_layers: int = 0  # checkpointed decoder layers whose inputs wait in pinned host memory
    # "layers": offloaded checkpointed layers replayed from CUDA graphs; "layer stack": all decoder layers
    # (no checkpointing); else "off: why"
    cuda_graphs: str = "off"
    moe_experts_grouped: int = 0  # 4-bit experts modules on one dequantization + grouped GEMM per projection
    family_modules: dict = field(default_factory=dict)  # GLA/Mamba: the family's own swaps (name -> modules)
    self_check: list = field(default_factory=list)  # KernelCheck.as_dict() of each kernel checked

    def as_dict(self) -> dict:
        return asdict(self)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the fast path cannot run here (None when it can): no CUDA, or no liger-kernel/triton."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        import liger_kernel.ops.swiglu  # noqa: F401
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except ImportError as exc:
        return f"liger-kernel is not importable ({exc}); pip install liger-kernel"
    return None


@dataclass(frozen=True)
class Decision:
    """Whether a run takes the fast path, why not, and the self-check behind it (made before the model is
    built: QLoRA's preparation differs on the fast path)."""

    enabled: bool
    reason: str = ""
    checks: tuple = ()


def decide(mode: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, checks=None) -> Decision:
    """``performance.fast_path`` on this device. Where the environment allows it, each kernel is first checked
    against eager PyTorch here (trainer/fastpath/selfcheck.py): a mismatch keeps the run on the reference
    path with a loud warning, or stops it when the fast path was forced 'on'."""
    if mode == "off":
        return Decision(False, "performance.fast_path: off")
    reason, results = unavailable_reason(device), ()
    if reason is None:
        results = selfcheck.run(device, dtype, checks)
        failed = selfcheck.failures(results)
        if failed:
            reason = "kernel self-check failed: " + selfcheck.describe_failures(failed)
    if reason and mode == "on":
        raise FastPathUnavailable(f"performance.fast_path: on, but {reason}")
    if reason and results:
        print(f"WARNING: the CUDA fast path is OFF for this run: {reason}; training on the reference path",
              file=sys.stderr, flush=True)  # fmt: skip
    return Decision(reason is None, reason or "", tuple(results))


def graphs_unavailable(
    mode: str,
    device: torch.device,
    offload: bool,
    processes: int,
    fast: bool = True,
    checkpointing: bool = False,
    packing: bool = True,
    grads_synced_after_step: bool = False,
    routed_experts: bool = False,
) -> str | None:
    """Why the decoder layers are not replayed from CUDA graphs (None: they are: the checkpointed ones with
    offloaded inputs through ``layer_graphs``, or without checkpointing all of them through ``stack_graphs``).
    With ``performance.cuda_graphs: on``, a reason stops the run instead.

    The whole stack's graphs hold every layer's activations in their pool for as long as the run lasts; a batch
    of another shape runs eagerly beside them, its activations on top. Packed batches all have one width (a
    short row's padding is unmasked so its batch replays: ``step.step_inputs``); unpacked batches take the
    width of their longest row, so without packing the stack is not graphed.

    Several processes: a graph adds its gradients straight into ``.grad``, where DDP's gradient hooks never see
    them. Only a run whose gradients are averaged once after the step (``grads_synced_after_step``,
    ``Config.grads_synced_after_step``) replays graphs under DDP (on 2x H200: 1.06-1.25x tokens/s for LoRA,
    1.64x for QLoRA, bench/RESULTS.md session 28).

    Mixture-of-experts layers (``routed_experts``: the model has routers) run eagerly: which tokens each expert
    takes changes from batch to batch, transformers' expert loop reads that on the host, and the expert-usage
    hooks copy the router's picks to the host at every forward; a replay would do neither (the embedded
    default's tiny MoE failed its capture on an H200, session 29)."""
    if mode == "off":
        return "performance.cuda_graphs: off"
    reason = None
    if device.type != "cuda":
        reason = "not a CUDA device"
    elif not fast:
        reason = "the fast path is off"
    elif checkpointing and not offload:
        reason = "checkpointed layers are graphed only with offloaded inputs (memory.offload_checkpoints; "
        reason += "LoRA or QLoRA, not under FSDP)"
    elif processes > 1 and not grads_synced_after_step:
        reason = f"{processes} processes: DDP's gradient hooks would not see the gradients a graph adds "
        reason += "(they are averaged after the step only with memory.oom_fallback on, LoRA-style, under DDP)"
    elif routed_experts:
        reason = "mixture-of-experts layers route each batch's tokens on the host (and the expert-usage "
        reason += "hooks read the router's picks), which a replay cannot repeat"
    elif not checkpointing and not packing:
        reason = "without packing (data.packing: false) rows change width from batch to batch, and a graphed "
        reason += "stack would hold one width's activations beside every other width's"
    if reason and mode == "on":
        raise FastPathUnavailable(f"performance.cuda_graphs: on, but {reason}")
    return reason


def wanted(mode: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, checks=None) -> bool:
    return decide(mode, device, dtype, checks).enabled


def _torch_rms_norm_forward(self, hidden):
    if hidden.dtype != self.weight.dtype:  # F.rms_norm's fused kernel wants one dtype; the model's own casts
        return type(self).forward(self, hidden)
    return F.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.variance_epsilon)


def use_torch_rms_norm(model) -> int:
    """RMSNorm through ``F.rms_norm`` (one fused CUDA kernel in recent PyTorch, launched from C++).

    The same maths as Liger's kernel with about a tenth of its host time: a Triton launch from Python costs
    ~0.15-0.2 ms on the H100 machines' CPUs against ~0.02 ms for an aten op, and a checkpointed Llama-1B step
    runs 99 norms (forward, recompute, backward), on a step whose host time is as long as its GPU time."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            if getattr(module, "weight", None) is not None and module.weight.dim() == 1:
                module.forward = _torch_rms_norm_forward.__get__(module)
                count += 1
    return count


def _apply_liger(model, rms_norm: bool = True) -> bool:
    """Liger's norm, RoPE and SwiGLU kernels on this model instance (its loss patches stay off: ours is used)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    base = model_head.unwrap(model)
    base = getattr(base, "get_base_model", lambda: base)()
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(getattr(base.config, "model_type", None))
    if apply is None:
        return False
    with _quiet_liger():
        apply(model=base, rope=True, rms_norm=rms_norm, swiglu=True, cross_entropy=False,
              fused_linear_cross_entropy=False)  # fmt: skip
    return True


@contextlib.contextmanager
def _quiet_liger():
    import logging

    logger = logging.getLogger("liger_kernel")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _report(model, decision: Decision) -> FastPathReport:
    """The report a fast path starts from; a model it does not apply to is marked as off (loss included)."""
    checks = [c.as_dict() for c in decision.checks]
    if not decision.enabled:
        setattr(model_head.unwrap(model), ENABLED_ATTRIBUTE, False)
        return FastPathReport(enabled=False, reason=decision.reason, self_check=checks)
    return FastPathReport(enabled=True, self_check=checks)


def _use_fused_loss(model) -> bool:
    """Mark the model's loss for the fused linear cross-entropy where its logits are exactly a bias-free
    ``lm_head(hidden)``; returns whether it was."""
    head = model_head.output_head(model)
    fused = model_head.supports_chunked_loss(model) and type(head) is torch.nn.Linear and head.bias is None
    setattr(model_head.unwrap(model), ENABLED_ATTRIBUTE, fused)
    return fused


def apply(
    model,
    decision: Decision,
    rms_norm: str = "torch",
    offload: bool = False,
    graphs_off: str | None = "not asked for",
) -> FastPathReport:
    """Put the fast path on ``model`` where ``decision`` allows; the report says what was done and carries the
    self-check's measured errors. ``offload``: checkpointed layers keep their inputs in pinned host memory
    (trainer/fastpath/offload.py). Under FSDP2 the fused nodes read each layer's weights at the call, as FSDP
    gathers them; so do the fused loss (accelerate keeps the head gathered from the forward's end) and the
    grouped 4-bit MoE experts (``moe_experts.PackedExperts.live``).
    ``graphs_off``: why the offloaded layers are not replayed from CUDA graphs (``graphs_unavailable``); None:
    they are."""
    report = _report(model, decision)
    if not report.enabled:
        return report
    report.liger_kernels = _apply_liger(model, rms_norm=rms_norm == "liger")
    if rms_norm == "torch":
        report.rms_norm = f"torch ({use_torch_rms_norm(model)} modules)"
    # MLP blocks first: their projections then stay on the block's function, not the per-module one.
    report.mlp_blocks_fused = patch_swiglu_mlps(model)
    report.lora_modules_fused, report.lora_modules_reference = patch_lora_linears(model)
    report.qkv_groups_fused = patch_qkv_groups(model)
    # Under FSDP the experts' 4-bit bytes are floating parameters it shards: concatenated at each call.
    report.moe_experts_grouped = patch_quantized_experts(model)
    if offload:
        graphs = LayerGraphs() if graphs_off is None else None
        report.offloaded_layers = offload_checkpointed_layers(model, graphs)
        report.cuda_graphs = "layers" if report.offloaded_layers else "off: no checkpointed decoder layers"
    elif graphs_off is None:
        report.cuda_graphs = graph_layer_stack(model)
    if graphs_off is not None:
        report.cuda_graphs = f"off: {graphs_off}"
    report.fused_loss = _use_fused_loss(model)
    if report.lora_modules_fused == 0 and lora_module_count(model) == 0:
        report.reason = "no LoRA modules (full fine-tuning): kernels and loss only"
    return report


def family_checks(method: str, extra: dict | None = None) -> dict:
    """The shipped checks a GLA or Mamba run's fast path needs (its LoRA projections, on a 4-bit base for
    QLoRA, and its loss), plus the family's own fast-path checks (``extra``). The family's sequence-mixing
    kernels have their own check (trainer/model/kernel_choice.py)."""
    names = ["fused_cross_entropy"] if method != "full" else ["fused_cross_entropy_trainable_head"]
    if method in ("lora", "qlora"):
        names.append("lora_linear")
    if method == "qlora":
        names.append("lora_linear_nf4")
    return {**{name: selfcheck.CHECKS[name] for name in names}, **(extra or {})}


def apply_to_family(
    model, decision: Decision, family_modules=None, graphs_off: str | None = "not asked for", eager_call=None
) -> FastPathReport:
    """The fast path on a GLA or Mamba model, whose sequence mixing runs the family's own kernels: each plain
    LoRA projection as one node, RMSNorm through ``F.rms_norm``, the fused linear cross-entropy where the
    logits are exactly ``lm_head(hidden)``, and ``family_modules(model)`` (the family's swaps of its own
    modules onto fused kernels; returns name -> modules swapped). No Liger model patch, MLP or Q/K/V
    grouping: those follow transformers' causal layers. Whether or not the fast path is on, ``graphs_off``
    None replays the decoder layers from CUDA graphs (``stack_graphs``), except the calls ``eager_call(kwargs)``
    says a graph cannot record."""
    report = _report(model, decision)
    report.cuda_graphs = f"off: {graphs_off}" if graphs_off else graph_layer_stack(model, eager_call)
    if not report.enabled:
        return report
    report.rms_norm = f"torch ({use_torch_rms_norm(model)} modules)"
    report.lora_modules_fused, report.lora_modules_reference = patch_lora_linears(model)
    if family_modules is not None:
        report.family_modules = family_modules(model)
    report.fused_loss = _use_fused_loss(model)
    return report


def decoder_layers(model) -> list:
    """The model's decoder layers (transformers' and fla's blocks are ``GradientCheckpointingLayer``s), outer
    ones only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = []
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(
            module in set(outer.modules()) for outer in found[-1:]
        ):
            found.append(module)
    return found


def graph_layer_stack(model, eager_call=None) -> str:
    """Replay the decoder layers from CUDA graphs (``stack_graphs``); the report's ``cuda_graphs`` value."""
    layers = decoder_layers(model)
    if not layers:
        return "off: no decoder layers found"
    graphs = StackGraphs(layers, eager_call=eager_call)
    if not graphs.install():
        return f"off: {graphs.off}"
    setattr(model, STACK_ATTRIBUTE, graphs)
    return "layer stack"


def layer_graphs_of(model) -> LayerGraphs | StackGraphs | None:
    """The CUDA graphs of ``model``'s layers (None where they are off)."""
    for holder in (model_head.unwrap(model), model):
        if getattr(holder, STACK_ATTRIBUTE, None) is not None:
            return getattr(holder, STACK_ATTRIBUTE)
    func = getattr(model_head.unwrap(model), OFFLOAD_ATTRIBUTE, None) or getattr(
        model, OFFLOAD_ATTRIBUTE, None
    )
    return getattr(func, "graphs", None)


def enabled(model) -> bool:
    """True when the loss of this model goes through the fused linear cross-entropy."""
    return bool(getattr(model_head.unwrap(model), ENABLED_ATTRIBUTE, False))


def _liger_flce():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def fused_loss_of(model):
    """The run's fused loss: where checkpointed layers replay from CUDA graphs, a frozen head's computes in
    their pool's free memory (``frozen_head_loss``)."""
    graphs = layer_graphs_of(model)
    if not isinstance(graphs, LayerGraphs):
        return fused_cross_entropy
    return lambda head, hidden, labels: fused_cross_entropy(head, hidden, labels, lend=graphs.lender())


def fused_cross_entropy(
    head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, lend=None
) -> torch.Tensor:
    """Summed next-token cross-entropy of ``hidden`` (B x T x H) through ``head``, never building the logits.

    Runs in the head's own dtype: accelerate hands the forward's outputs back in fp32 under mixed precision,
    and casting the 128k x H head up to match would copy it (a GiB) and run the head in fp32 every step.
    A frozen head's loss (LoRA, QLoRA) runs the kit's own node over Liger's forward (``frozen_head_loss``: no
    host sync in its backward), computing its transient tensors inside ``lend`` where given
    (``CudaGraphs.run_in_free_memory``); a trainable head's runs Liger's own node.
    """
    dtype = head.weight.dtype
    # Each position's target is the next token; a row's last position has none.
    targets = labels.new_full(labels.shape, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    targets = targets.reshape(-1)
    # Rows picked by an index found where the labels are (the collated batch is on the host), so the GPU is
    # not asked how many rows survive: a boolean mask on a GPU tensor would stall the host until the GPU
    # caught up with the whole forward. Picked from the flattened states (a view): one copy, not a shifted
    # copy and then a picked one. Prompt and padding tokens need no logits at all.
    index = (targets != IGNORE).nonzero().squeeze(1)
    if index.numel() == 0:
        return hidden.float().sum() * 0.0
    device = hidden.device
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = to_device(targets[index], device)  # pinned first: no wait on the forward queued before
    index = to_device(index, device)
    if torch.is_grad_enabled() and hidden.requires_grad and not head.weight.requires_grad:
        lend = lend or frozen_head_loss.here
        return frozen_head_loss.FrozenHeadLoss.apply(
            flat, head.weight, index, labels, _flce_forward(), lend, logit_chunk_budget(flat)
        )
    hidden = flat.to(dtype).index_select(0, index)
    del flat
    return _liger_flce()(
        hidden,
        head.weight,
        labels,
        ignore_index=IGNORE,
        reduction="sum",
        chunk_mem_const=logit_chunk_budget(hidden),
    )


def _flce_forward():
    return frozen_head_loss.liger_forward()


def logit_chunk_budget(hidden: torch.Tensor) -> int:
    """Liger's ``chunk_mem_const``: the transient logits of one chunk may hold this many times tokens x hidden.

    Liger's default (1) sizes chunks by the hidden size, so a narrow model gets tiny chunks: Qwen3-0.6B
    (hidden 1024, vocabulary 152k) ran 128 chunks of 64 tokens per micro-batch, each a few host-bound
    launches. Sizing by ~4096 x tokens instead gives 256-token chunks for both Qwen3-0.6B and Llama-1B
    (transient logits ~70 MB in bf16)."""
    return max(1, 4096 // hidden.shape[-1])


def reference_cross_entropy(head, hidden, labels) -> torch.Tensor:
    """The same quantity computed the plain way (tests and the GPU check compare against it)."""
    logits = head(hidden[:, :-1]).float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
