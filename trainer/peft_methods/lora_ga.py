"""LoRA-GA initialisation (Wang et al., "LoRA-GA: Low-Rank Adaptation with Gradient Approximation",
NeurIPS 2024), for every family.

The full fine-tuning gradient G of each target weight is estimated on ``lora.lora_ga_batches``
micro-batches of the training data (token-normalised over all of them, as one accumulated step, under
the run's autocast). With G = U S V^T: A = V[:, :r]^T and B = U[:, r:2r], both times
d_out^(1/4) / sqrt(gamma) (the paper's stable scale; ``lora.lora_ga_gamma``). The first update of
such an adapter is then G's best rank-2r approximation, where a default init only sees G through r
random directions. The frozen weight is offset by -s B A (s: the LoRA scaling) so that the model's
output is unchanged at step 0.

peft 0.21 ships LoRA-GA too (``init_lora_weights="lora_ga"``), but multiplies B by the singular values
and scales B only, which is not the paper's rule (its reference code scales A and B alike and uses
no singular values), and it refuses 4-bit bases. So the SVD and scaling are here, ~30 lines;
PEFT still builds the adapters.

Gradients come from hooks on each target's base layer (input x, output gradient g: G = sum g^T x),
never from the base weight itself, so a 4-bit base (QLoRA) gets its gradient without dequantizing
anything by hand (bitsandbytes' backward dequantizes for the input gradient as it always does).

The offset is never written into the frozen weight. In 16-bit it could not be: s B0 A0 is about as
large as W (at the stable scale its top singular values match W's), so W - s B0 A0 rounded to bf16
carries a rounding error the size of W's own, fixed for the whole run, and the adapter's large output
is added to the base's in bf16 and rounded again; both no longer cancel. On a Mamba-2 the step-0 loss
moved 10.33 -> 10.52 that way, and a 4-bit weight cannot take it without requantizing at all. So each
layer keeps its base weight and computes its adapter term as s [B, -B0] [A dropout(x); A0 x] (a PEFT
``LoraVariant``): the two rank-r halves of one rank-2r product, whose cancellation happens inside one
GEMM's fp32 accumulator before anything is added to the base output. At step 0, B = B0 and A = A0, so
the term is 0 up to fp32 rounding and the output is the base's in every precision; later it is the
small s(BA - B0A0) x, rounded once. Cost: one extra rank-r product per layer; the CUDA fast path's fused
LoRA kernels (trainer/fastpath/patch.py) run the same rank-2r pair.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

ADAPTER = "default"
OFFSET_KIND = "side_term"  # the lora_ga_init event's `offset` counts layers by kind
# The step-0 check's tolerance on the loss, relative (to max(1, loss)). The offset cancels inside one fp32
# accumulator, so the check reads 0 in fp32 and bf16 alike (to ~1e-7); 1e-4 leaves room for a kernel that
# is not bit-reproducible between two forwards and stays 15x below the smallest drift the old in-weight
# offset gave in bf16 (1.5e-3 of the loss on CPU; 1.8e-2 on an H100).
STEP0_RTOL = 1e-4


class LoraGaError(ValueError):
    """A LoRA-GA setting or file that does not fit this model."""


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """PEFT's LoRA layers by name in the transformers model; only Linear ones can take LoRA-GA."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.r:
            continue
        if ADAPTER not in module.lora_A or not isinstance(module.lora_A[ADAPTER], torch.nn.Linear):
            raise LoraGaError(
                f"lora.init: lora_ga factorises Linear weights; {name} is a {type(module.get_base_layer()).__name__} "
                "(remove it from lora.target_modules)"
            )
        layers[name] = module
    if not layers:
        raise LoraGaError("lora.init: lora_ga found no LoRA layers to initialise")
    return layers


def is_4bit(weight) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(weight, bnb.nn.Params4bit)


# ---------------------------------------------------------------- the gradient


def estimate_gradients(
    model, layers: dict, batches: list[dict], loss_fn, accelerator
) -> dict[str, torch.Tensor]:
    """G of every target weight (fp32, [out, in]) over ``batches``, normalised by all their target tokens.

    Nothing else gets a gradient: every parameter is frozen meanwhile and the embeddings' output is
    made to require one, so backward runs through the model and only the hooks collect."""
    from trainer.data.batches import count_targets

    grads = {
        n: torch.zeros(m.out_features, m.in_features, dtype=torch.float32, device=_device(m))
        for n, m in layers.items()
    }
    hooks = []

    def on_forward(name):
        def hook(module, args, output):
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            x = args[0].detach()

            def on_grad(g):
                grads[name].addmm_(
                    g.reshape(-1, g.shape[-1]).float().t().to(grads[name].device),
                    x.reshape(-1, x.shape[-1]).float().to(grads[name].device),
                )

            output.register_hook(on_grad)

        return hook

    for name, layer in layers.items():
        hooks.append(layer.get_base_layer().register_forward_hook(on_forward(name)))
    hooks.append(
        model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_(True))
    )
    frozen = {p: p.requires_grad for p in model.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    was_training = model.training
    model.train()
    try:
        total = max(1, sum(count_targets(b) for b in batches))
        for batch in batches:
            ce_sum, _ = loss_fn(model, batch, accelerator)
            (ce_sum / total).backward()
    finally:
        for h in hooks:
            h.remove()
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return grads


def _device(layer) -> torch.device:
    return layer.lora_A[ADAPTER].weight.device


# ---------------------------------------------------------------- SVD and scaling


def factorise(grad: torch.Tensor, r: int, gamma: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A0 [r, in], B0 [out, r]) from G [out, in]: the paper's ArB2r split and stable scale.

    Randomised SVD (q = 4r, 4 power iterations, as the paper's code) under a fixed seed, so every run
    and every process gets the same factors; where G has fewer than 2r singular directions, the missing
    columns of B0 (or rows of A0) stay zero."""
    out_features, in_features = grad.shape
    q = min(4 * r, out_features, in_features)
    with torch.random.fork_rng(devices=[grad.device] if grad.device.type == "cuda" else []):
        torch.manual_seed(seed)
        U, S, V = torch.svd_lowrank(grad.float(), q=q, niter=4)
    A0 = torch.zeros(r, in_features, dtype=torch.float32, device=grad.device)
    B0 = torch.zeros(out_features, r, dtype=torch.float32, device=grad.device)
    a = min(r, V.shape[1])
    A0[:a] = V[:, :a].t()
    b = max(0, min(r, U.shape[1] - r))
    B0[:, :b] = U[:, r : r + b]
    scale = out_features**0.25 / math.sqrt(gamma)
    return A0 * scale, B0 * scale


# ---------------------------------------------------------------- applying an init


def set_adapter_weights(layer, A0: torch.Tensor, B0: torch.Tensor) -> None:
    with torch.no_grad():
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        a.copy_(A0.to(a.dtype))
        b.copy_(B0.to(b.dtype))


class LoraGaVariant:
    """PEFT's LoRA-variant hooks for one LoRA-GA layer: the adapter term minus the frozen initial one, as
    one rank-2r product (see the module docstring), in the forward and when PEFT merges (export --merge)."""

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:  # attached after PEFT built the layer
        pass

    @staticmethod
    def supports_lora_conversion() -> bool:
        return False

    @staticmethod
    def delta_weight(module, adapter: str) -> torch.Tensor:
        """s (B A - B0 A0) in fp32: what merging adds to the base weight."""
        A, B = module.lora_A[adapter].weight.float(), module.lora_B[adapter].weight.float()
        A0, B0 = module.lora_ga_A0.float(), module.lora_ga_B0.float()
        return (B @ A - B0 @ A0) * module.scaling[adapter]

    @classmethod
    def merge_safe(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        delta = cls.delta_weight(module, active_adapter).to(orig_weight.device)
        return (orig_weight.float() + delta).to(orig_weight.dtype)

    @classmethod
    def merge_unsafe(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data = cls.merge_safe(module, active_adapter, orig_weight.data)

    @classmethod
    def unmerge(cls, module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        delta = cls.delta_weight(module, active_adapter).to(orig_weight.device)
        return (orig_weight.float() - delta).to(orig_weight.dtype)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
        A0, B0 = module.lora_ga_A0, module.lora_ga_B0
        trained = lora_A(module.lora_dropout[active_adapter](x))
        frozen = F.linear(x, A0)  # x: cast to the adapter's dtype by PEFT unless autocast decides
        both = torch.cat([trained, frozen.to(trained.dtype)], dim=-1)
        weight = torch.cat([lora_B.weight, -B0.to(lora_B.weight.dtype)], dim=1)
        return result + F.linear(both, weight) * module.scaling[active_adapter]


def apply_offset(layer, A0: torch.Tensor, B0: torch.Tensor) -> str:
    """Make the layer compute s(BA - B0A0) x instead of s BA x (once), on an unchanged base weight of any
    kind (16/32-bit or 4-bit). ``A0``/``B0`` as the adapter holds them at step 0, so the two cancel."""
    if ADAPTER in layer.lora_variant:
        if not isinstance(layer.lora_variant[ADAPTER], LoraGaVariant):
            raise LoraGaError(
                f"lora_ga cannot combine with the layer's LoRA variant {layer.lora_variant[ADAPTER]}"
            )
        return OFFSET_KIND
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    layer.register_buffer(
        "lora_ga_A0", A0.detach().to(device=a.device, dtype=a.dtype).clone(), persistent=False
    )
    layer.register_buffer(
        "lora_ga_B0", B0.detach().to(device=b.device, dtype=b.dtype).clone(), persistent=False
    )
    layer.lora_variant[ADAPTER] = LoraGaVariant()
    # the CUDA fast path caches each layer's LoRA pair; this one now adds the initial factors (patch.cached_parts)
    layer.__dict__.pop("_kit_lora_parts", None)
    return OFFSET_KIND


def init_tensors(layers: dict) -> dict[str, torch.Tensor]:
    """The adapters' current A and B, as saved for resume and export (``<layer>.A0`` / ``<layer>.B0``)."""
    tensors = {}
    for name, layer in layers.items():
        tensors[f"{name}.A0"] = layer.lora_A[ADAPTER].weight.detach().cpu().contiguous()
        tensors[f"{name}.B0"] = layer.lora_B[ADAPTER].weight.detach().cpu().contiguous()
    return tensors


def factors(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return tensors[f"{name}.A0"], tensors[f"{name}.B0"]
    except KeyError as exc:
        raise LoraGaError(f"the LoRA-GA init has no factors for {name}; use a new paths.output_dir") from exc


def apply_init(layers: dict, tensors: dict, set_weights: bool = True) -> dict[str, int]:
    """Set each adapter to its saved init (``set_weights``) and offset its base. Counts the offsets by kind."""
    kinds: dict[str, int] = {}
    for name, layer in layers.items():
        A0, B0 = factors(tensors, name)
        if tuple(A0.shape) != tuple(layer.lora_A[ADAPTER].weight.shape):
            raise LoraGaError(
                f"the LoRA-GA init's {name}.A0 is {tuple(A0.shape)}, the adapter {tuple(layer.lora_A[ADAPTER].weight.shape)} "
                "(lora.r or the targets changed); use a new paths.output_dir"
            )
        if set_weights:
            set_adapter_weights(layer, A0, B0)
        kind = apply_offset(layer, A0, B0)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def initialise(model, cfg, batches: list[dict], loss_fn, accelerator) -> tuple[dict, dict]:
    """Estimate, factorise, set and offset; returns the init tensors and the ``lora_ga_init`` event's fields,
    with the step-0 check: the first batch's loss before and after, in eval mode."""
    layers = lora_layers(model)
    started = time.time()
    before = _loss(model, batches[0], loss_fn, accelerator)
    grads = estimate_gradients(model, layers, batches, loss_fn, accelerator)
    estimated = time.time()
    for name, layer in layers.items():
        A0, B0 = factorise(grads.pop(name), cfg.lora.r, cfg.lora.lora_ga_gamma, cfg.training.seed)
        set_adapter_weights(layer, A0, B0)
        # the offset from the adapter's own (possibly rounded) values, so it cancels exactly
        apply_offset(layer, layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach())
    after = _loss(model, batches[0], loss_fn, accelerator)
    event = {
        "modules": len(layers),
        "batches": len(batches),
        "seconds": round(time.time() - started, 3),
        "gradient_seconds": round(estimated - started, 3),
        "offset": {OFFSET_KIND: len(layers)},
        "step0_loss_base": before,
        "step0_loss_lora_ga": after,
        "step0_abs_diff": abs(after - before),
        "step0_tolerance": step0_tolerance(before),
        "step0_ok": abs(after - before) <= step0_tolerance(before),
    }
    return init_tensors(layers), event


def step0_tolerance(loss: float) -> float:
    return STEP0_RTOL * max(1.0, abs(loss))


@torch.no_grad()
def _loss(model, batch, loss_fn, accelerator) -> float:
    from trainer.data.batches import count_targets

    was_training = model.training
    model.eval()
    try:
        ce_sum, _ = loss_fn(model, batch, accelerator)
    finally:
        model.train(was_training)
    return float(ce_sum) / max(1, count_targets(batch))


def as_plain_lora(
    adapter: dict[str, torch.Tensor], init: dict[str, torch.Tensor], prefix: str = "base_model.model."
) -> dict:
    """A LoRA-GA adapter as a plain rank-2r LoRA on the unmodified base: s(BA - B0A0) = s [B, -B0] [A; A0].

    ``adapter``: the saved adapter's tensors (PEFT's key names); the scaling of rank 2r must equal the
    rank-r one, which the caller arranges through ``lora_alpha`` (see ``trainer.tools.export``)."""
    out = dict(adapter)
    for key in [k for k in adapter if k.endswith("lora_A.weight")]:
        layer = key[len(prefix) : -len(".lora_A.weight")]
        A0, B0 = factors(init, layer)
        b_key = key.replace("lora_A.weight", "lora_B.weight")
        out[key] = torch.cat([adapter[key], A0.to(adapter[key].dtype)], dim=0)
        out[b_key] = torch.cat([adapter[b_key], -B0.to(adapter[b_key].dtype)], dim=1)
    return out
