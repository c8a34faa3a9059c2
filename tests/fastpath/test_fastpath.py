"""The CUDA fast path's pieces, checked on CPU in fp32 against PEFT's own modules and eager PyTorch.

The fused LoRA autograd functions run on CPU (eager elementwise ops stand in for Liger's Triton SwiGLU),
so each is compared here with the reference path: forward output, input gradient and every LoRA gradient,
on a bf16-free fp32 model and on a real 4-bit (bitsandbytes CPU backend) QLoRA model. The GPU benchmark
repeats the comparison on the card, with Liger's kernels and the fused loss.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import REPO
from trainer.config import load_config
from trainer.fastpath import FastPathUnavailable, apply, decide, enabled, wanted
from trainer.fastpath.lora_ops import BaseWeight, lora_linear, lora_mlp
from trainer.fastpath.lora_ops import lora_group as patch_lora_group
from trainer.fastpath.patch import patch_lora_linears, patch_swiglu_mlps, unpatch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def load(write_config, method: str, **lora):
    from trainer.model.loading import load_for_training

    lora_cfg = {"dropout": 0.0, "target_modules": ALL_LINEAR, **lora}
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(REPO / "configs" / "tiny-llama")},
                "training": {"method": method},
                "lora": lora_cfg,
                "quantization": {"compute_dtype": "fp32"},  # the reference's 4-bit matmul in fp32 too
            }
        )
    )
    model = load_for_training(cfg, torch.device("cpu")).model
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would hide a wrong gradient for A
            param.data.normal_(0, 0.05)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), embeds.grad.detach().clone(), grads


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_fused_lora_model_matches_peft_in_fp32(write_config, method, monkeypatch):
    from trainer.fastpath import patch

    model = load(write_config, method)
    ids = torch.randint(3, 1024, (2, 24))
    ref_loss, ref_dx, ref_grads = loss_and_grads(model, ids)
    mlps = patch_swiglu_mlps(model)
    patched, skipped = patch_lora_linears(model)
    groups = patch.patch_qkv_groups(model)
    assert (mlps, patched, skipped, groups) == (2, 14, 0, 2)
    grouped_calls = []
    monkeypatch.setattr(patch, "lora_group", lambda *a: grouped_calls.append(1) or patch_lora_group(*a))
    loss, dx, grads = loss_and_grads(model, ids)
    assert len(grouped_calls) == 2  # Q/K/V really ran as one node in each layer of the real attention code
    assert abs(float(loss - ref_loss)) < 1e-5
    assert rel_err(dx, ref_dx) < 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, name
    unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if hasattr(m, "lora_A"))


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_ga_layers_run_fused_as_one_rank_2r_pair(write_config, method, monkeypatch):
    """LoRA-GA's layers (s [B, -B0] [A; A0] x, trainer/peft_methods/lora_ga.py), made LoRA-GA after the fast
    path patched them as the loop does: the fused functions give PEFT's loss and gradients in fp32, and the
    frozen initial factors get none."""
    from trainer.fastpath import patch
    from trainer.peft_methods.lora_ga import apply_offset

    model = load(write_config, method)
    patch_swiglu_mlps(model), patch_lora_linears(model), patch.patch_qkv_groups(model)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    for layer in layers:  # initial factors, then trained ones that differ: the term is not zero
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        apply_offset(layer, torch.randn_like(a) * 0.05, torch.randn_like(b) * 0.05)
    assert all(patch.cached_parts(layer)[0].shape[0] == 2 * 8 for layer in layers)
    calls = []
    for name in ("lora_linear", "lora_group", "lora_mlp"):
        fused = getattr(patch, name)
        monkeypatch.setattr(patch, name, lambda *a, _f=fused, _n=name: calls.append(_n) or _f(*a))
    ids = torch.randint(3, 1024, (2, 24))
    loss, dx, grads = loss_and_grads(model, ids)
    assert sorted(set(calls)) == ["lora_group", "lora_linear", "lora_mlp"]  # Q/K/V, O and the MLP blocks
    unpatch(model)
    ref_loss, ref_dx, ref_grads = loss_and_grads(model, ids)
    assert abs(float(loss - ref_loss)) < 1e-5 and rel_err(dx, ref_dx) < 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, name
    assert all(layer.lora_ga_A0.grad is None for layer in layers)


def test_ineligible_modules_keep_pefts_forward(write_config):
    """DoRA (a LoRA variant) and dropout change the maths: those modules must stay on PEFT's path."""
    dora = load(write_config, "lora", variant="dora")
    assert patch_swiglu_mlps(dora) == 0
    assert patch_lora_linears(dora) == (0, 14)
    dropout = load(write_config, "lora", dropout=0.1)
    assert patch_lora_linears(dropout) == (0, 14)


def test_fused_nodes_read_the_parameters_a_module_holds_at_each_call(write_config):
    """FSDP2 puts other tensors on a layer's modules than the ones its first forward saw (sharded, or gathered
    again, and ``fully_shard`` may come after a first forward): the fused node uses, and trains, the ones there now."""
    model = load(write_config, "lora")
    patch_lora_linears(model)
    module = next(m for n, m in model.named_modules() if n.endswith("self_attn.q_proj"))
    x = torch.randn(2, 5, module.base_layer.in_features)
    module(x)  # the first call works out (and caches) the module's parts
    fresh = torch.nn.Parameter(module.lora_B["default"].weight.detach() * 3)
    module.lora_B["default"].weight = fresh
    expected = (
        module.base_layer(x)
        + module.scaling["default"] * (x @ module.lora_A["default"].weight.t()) @ fresh.t()
    )
    out = module(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert fresh.grad is not None and fresh.grad.abs().sum() > 0


def test_lora_linear_with_bias_and_4bit_base_matches_eager():
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    torch.manual_seed(1)
    q, state = bnbf.quantize_4bit(torch.randn(48, 64) * 0.1, quant_type="nf4", compress_statistics=True)
    weight = bnb.nn.Params4bit(
        q, requires_grad=False, quant_state=state, bnb_quantized=True, quant_type="nf4"
    )
    bias = torch.randn(48)
    dense = bnbf.dequantize_4bit(q, state).float()
    a = (torch.randn(8, 64) * 0.1).requires_grad_(True)
    b = (torch.randn(48, 8) * 0.1).requires_grad_(True)
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = lora_linear(x, a, b, BaseWeight(weight, bias), 2.0)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = (out.detach(), x.grad.clone(), a.grad.clone(), b.grad.clone())
    for t in (x, a, b):
        t.grad = None
    ref = x @ dense.t() + bias + 2.0 * (x @ a.t()) @ b.t()
    ref.backward(grad)
    for mine, theirs in zip(got, (ref.detach(), x.grad, a.grad, b.grad)):
        assert rel_err(mine, theirs) < 1e-5


def mlp_case(hidden: int = 32, inter: int = 80, r: int = 4):
    """A SwiGLU block's frozen weights, LoRA pairs and scales, and its eager fp32 forward ``reference(x)``."""
    torch.manual_seed(2)
    weights = [
        torch.randn(inter, hidden) * 0.1,
        torch.randn(inter, hidden) * 0.1,
        torch.randn(hidden, inter) * 0.1,
    ]
    loras = [
        (
            (torch.randn(r, w.shape[1]) * 0.1).requires_grad_(True),
            (torch.randn(w.shape[0], r) * 0.1).requires_grad_(True),
        )
        for w in weights
    ]
    scales = (0.5, 1.5, 2.0)

    def proj(inp, i):
        (a, b), w, s = loras[i], weights[i], scales[i]
        return inp @ w.t() + s * (inp @ a.t()) @ b.t()

    def reference(x):
        return proj(torch.nn.functional.silu(proj(x, 0)) * proj(x, 1), 2)

    parts = [(a, b, BaseWeight(w, None), s) for (a, b), w, s in zip(loras, weights, scales)]
    return parts, [t for pair in loras for t in pair], reference


def test_lora_mlp_matches_eager_swiglu():
    parts, lora_leaves, reference = mlp_case()
    x = torch.randn(2, 7, 32, requires_grad=True)
    out = lora_mlp(x, *parts)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [x] + lora_leaves
    got = [out.detach()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref = reference(x)
    ref.backward(grad)
    for mine, theirs in zip(got, [ref.detach()] + [t.grad for t in leaves]):
        assert rel_err(mine, theirs) < 1e-5


def test_lora_mlp_backward_writes_the_activations_gradient_over_the_recomputed_activation(monkeypatch):
    """The MLP's backward holds one (tokens x intermediate) tensor fewer at its peak: dh goes into the
    recomputed h, which dA of the down projection read last (the lever against the graphs' pool size)."""
    from trainer.fastpath import lora_ops

    seen = {}
    swiglu, swiglu_backward = lora_ops._swiglu, lora_ops._swiglu_backward

    def recording_swiglu(e, g):
        seen.setdefault("h", []).append(out := swiglu(e, g))
        return out

    def recording_backward(e, g, dh):
        seen["dh"] = dh
        return swiglu_backward(e, g, dh)

    monkeypatch.setattr(lora_ops, "_swiglu", recording_swiglu)
    monkeypatch.setattr(lora_ops, "_swiglu_backward", recording_backward)
    test_lora_mlp_matches_eager_swiglu()  # and the gradients stay the eager ones
    forward_h, backward_h = seen["h"][0], seen["h"][1]
    assert seen["dh"].data_ptr() == backward_h.data_ptr() != forward_h.data_ptr()


@pytest.mark.parametrize("base_last", [True, False])
def test_low_rank_then_base_is_the_eager_sum_in_either_order(monkeypatch, base_last):
    """The rank-r product written first and the full GEMMs added onto it (the order the fast path runs), or the
    other way round: the eager sum in fp32; a reused output's old contents, NaN included, are ignored."""
    from trainer.fastpath import lora_ops

    monkeypatch.setattr(lora_ops, "BASE_GEMM_LAST", base_last)
    torch.manual_seed(4)
    low, up = torch.randn(9, 3), torch.randn(3, 7)
    terms = [(torch.randn(9, 5), torch.randn(5, 7)), (torch.randn(9, 4), torch.randn(4, 7))]
    expected = 0.5 * low @ up + sum(x @ w for x, w in terms)
    out = torch.full((9, 7), float("nan"))
    got = lora_ops.low_rank_then_base(out, low, up, 0.5, iter(terms))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_ops.low_rank_then_base(None, low, up, 0.5, terms), expected)
    bias = torch.randn(7)  # a biased projection's bias, in the first GEMM's epilogue
    with_bias = lora_ops.low_rank_then_base(None, low, up, 0.5, terms, bias)
    torch.testing.assert_close(with_bias, expected + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base_last", [True, False])
def test_group_backward_uses_each_base_before_the_next_overwrites_it(monkeypatch, base_last):
    """4-bit bases of one shape dequantize into one shared buffer (K and V, gate and up): dx must use each
    weight before the next is written there. A stand-in base that shares one buffer gives the eager dx."""
    from trainer.fastpath import lora_ops

    monkeypatch.setattr(lora_ops, "BASE_GEMM_LAST", base_last)
    torch.manual_seed(5)
    shared = torch.empty(6, 5)

    class SharedBuffer:
        bias = None

        def __init__(self, weight):
            self.weight = weight

        def materialize(self, dtype):
            return shared.copy_(self.weight)

    weights = [torch.randn(6, 5), torch.randn(6, 5)]
    a_list = [torch.randn(2, 5), torch.randn(2, 5)]
    b_list = [torch.randn(6, 2), torch.randn(6, 2)]
    x2, dys = torch.randn(4, 5), [torch.randn(4, 6), torch.randn(4, 6)]
    xa = x2 @ torch.cat(a_list).t()
    bases = [SharedBuffer(w) for w in weights]
    dx, _ = lora_ops._group_backward(dys, x2, xa, torch.cat(a_list), bases, b_list, (1.0, 2.0), True)
    expected = sum(
        dy @ w + s * (dy @ b) @ a for dy, w, a, b, s in zip(dys, weights, a_list, b_list, (1.0, 2.0))
    )
    torch.testing.assert_close(dx, expected, rtol=1e-5, atol=1e-5)


def test_autograd_functions_pass_gradcheck_in_fp64():
    torch.manual_seed(3)
    w = torch.randn(6, 5, dtype=torch.float64)
    a = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    base = BaseWeight(w, torch.randn(6, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x, a, b: lora_linear(x, a, b, base, 0.7), (x, a, b))


def test_fast_path_is_refused_on_cpu_and_off_is_respected():
    cpu = torch.device("cpu")
    assert wanted("auto", cpu) is False
    assert wanted("off", cpu) is False
    with pytest.raises(FastPathUnavailable, match="performance.fast_path: on, but not a CUDA device"):
        wanted("on", cpu)
    model = torch.nn.Linear(2, 2)
    report = apply(model, decide("auto", cpu))
    assert not report.enabled and report.reason == "not a CUDA device" and not enabled(model)
    assert report.self_check == []  # nothing to check where the fast path cannot run


@pytest.mark.slow
def test_fast_path_on_without_cuda_is_a_one_line_config_error(write_config):
    from tests.helpers import run_trainer

    config = write_config({"performance": {"fast_path": "on"}, "training": {"max_steps": 1}})
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "performance.fast_path: on, but not a CUDA device" in result.stderr


def test_lora_weights_are_cast_once_until_the_optimizer_changes_them():
    from trainer.fastpath.lora_ops import cast

    param = torch.nn.Parameter(torch.randn(4, 3))
    first = cast(param, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and cast(param, torch.bfloat16) is first
    param.grad = torch.ones_like(param)
    torch.optim.SGD([param], lr=0.1).step()  # an in-place update bumps the version
    second = cast(param, torch.bfloat16)
    assert second is not first and torch.equal(second, param.detach().to(torch.bfloat16))
    assert cast(param, torch.float32) is param


def test_cast_cache_sees_updates_that_leave_the_version_alone():
    """A fused AdamW (the CUDA default) writes parameters without bumping their version counters: the cache
    must learn of the step from the optimizer itself, and refreshes every stale copy at once."""
    from trainer.fastpath.lora_ops import cast, track_updates

    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    before = [cast(p, torch.bfloat16) for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.5, fused=True)
    track_updates(optimizer)
    for p in params:
        p.grad = torch.ones_like(p)
    versions = [p._version for p in params]
    optimizer.step()
    assert [p._version for p in params] == versions  # the case the version alone would miss
    first = cast(params[0], torch.bfloat16)
    refreshed = [p._kit_cast[3] for p in params]  # all three refreshed by the first call
    for p, old, new in zip(params, before, refreshed):
        assert torch.equal(new, p.detach().to(torch.bfloat16)) and not torch.equal(new, old)
    assert first is refreshed[0] and cast(params[2], torch.bfloat16) is refreshed[2]


def test_make_optimizer_tells_the_cast_cache_of_each_step(write_config):
    from trainer.fastpath import lora_ops
    from trainer.training.optim import make_optimizer

    cfg = load_config(write_config({"model": {"name_or_path": str(REPO / "configs" / "tiny-llama")}}))
    model = torch.nn.Linear(3, 4)
    optimizer = make_optimizer(model, cfg, on_cuda=False)
    generation = lora_ops._generation
    model.weight.grad, model.bias.grad = torch.ones(4, 3), torch.ones(4)
    optimizer.step()
    assert lora_ops._generation == generation + 1


def test_logit_chunks_are_sized_by_tokens_not_by_the_hidden_size():
    from trainer.fastpath import logit_chunk_budget

    # Liger's chunk = tokens / ceil(vocab / (budget x hidden)): about 4096 x tokens of logits at either width
    assert logit_chunk_budget(torch.empty(8, 1024)) == 4
    assert logit_chunk_budget(torch.empty(8, 2048)) == 2
    assert logit_chunk_budget(torch.empty(8, 8192)) == 1


def test_torch_rms_norm_matches_the_models_own():
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.fastpath import use_torch_rms_norm

    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama"))
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.data.uniform_(0.5, 1.5)
    ids = torch.randint(3, 1024, (2, 16))
    reference = model(ids).logits
    assert use_torch_rms_norm(model) == 2 * 2 + 1
    assert rel_err(model(ids).logits, reference) < 1e-5
    # A bf16 input on an fp32 weight (F.rms_norm's fused kernel wants one dtype) keeps the model's own maths.
    norm = model.model.norm
    hidden = torch.randn(2, 16, norm.weight.shape[0]).to(torch.bfloat16)
    assert torch.equal(norm(hidden), type(norm).forward(norm, hidden))


def test_fused_loss_runs_in_the_heads_dtype_whatever_accelerate_hands_back(monkeypatch):
    """accelerate returns fp32 outputs under bf16 mixed precision: the head must not be upcast to match."""
    import trainer.fastpath as fastpath

    seen = {}

    def fake_flce(hidden, weight, labels, ignore_index, reduction, chunk_mem_const):
        seen.update(hidden=hidden.dtype, weight=weight.dtype, n=labels.numel(), reduction=reduction)
        return fastpath.reference_cross_entropy(
            torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False), hidden[None].float(), labels[None]
        )

    monkeypatch.setattr(fastpath, "_liger_flce", lambda: fake_flce)
    head = torch.nn.Linear(8, 11, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 5, 8)  # fp32, as accelerate's convert_outputs_to_fp32 leaves it
    labels = torch.tensor([[1, 2, -100, 4, 5], [6, -100, -100, 9, 10]])
    fastpath.fused_cross_entropy(head, hidden, labels)
    assert seen == {"hidden": torch.bfloat16, "weight": torch.bfloat16, "n": 5, "reduction": "sum"}


def test_fused_loss_picks_each_positions_next_token_and_skips_ignored_ones(monkeypatch):
    """The rows the fused loss gets (picked from the flattened states, each with the next token as target,
    a row's last position and ignored targets left out) give the plain shifted cross-entropy and its gradient."""
    import torch.nn.functional as F

    import trainer.fastpath as fastpath

    def plain_flce(hidden, weight, labels, ignore_index, reduction, chunk_mem_const):
        return F.cross_entropy(hidden @ weight.t(), labels, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(fastpath, "_liger_flce", lambda: plain_flce)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([[1, 2, -100, 4, 5], [6, -100, -100, 9, 10], [3, 3, 3, 3, -100]])
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    fused = fastpath.fused_cross_entropy(head, hidden, labels)
    (fused_grad,) = torch.autograd.grad(fused, hidden)
    reference = fastpath.reference_cross_entropy(head, hidden, labels)
    (reference_grad,) = torch.autograd.grad(reference, hidden)
    assert torch.allclose(fused, reference, atol=1e-5)
    assert torch.allclose(fused_grad, reference_grad, atol=1e-6)
    assert torch.all(fused_grad[:, -1] == 0)  # a row's last position has no next token
    all_ignored = torch.full_like(labels, -100)
    assert fastpath.fused_cross_entropy(head, hidden, all_ignored).item() == 0.0


@pytest.mark.slow
def test_model_report_says_whether_the_fast_path_ran(write_config, tmp_path):
    import json

    from tests.helpers import run_trainer

    config = write_config({"training": {"max_steps": 1}})
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    events = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    report = next(e for e in events if e["event"] == "model_report")
    assert report["fast_path"]["enabled"] is False and report["fast_path"]["reason"] == "not a CUDA device"
    assert report["chunked_loss"] is True  # the reference path's loss, as before


# ------------------------------------------------------------------ the kernel self-check


def scaled_gradient_lora_linear(x, a, b, base, scale):
    """Right forward, backward off by half: the kind of bug a forward-only check would miss."""
    from trainer.fastpath.lora_ops import lora_linear

    out = lora_linear(x, a, b, base, scale)
    return out + 0.5 * (out - out.detach())


def cpu_checks(lora_linear_kernel=None):
    import functools

    from trainer.fastpath import selfcheck

    checks = {"lora_linear": selfcheck.check_lora_linear, "lora_mlp": selfcheck.check_lora_mlp}
    if lora_linear_kernel is not None:
        checks["lora_linear"] = functools.partial(selfcheck.check_lora_linear, kernel=lora_linear_kernel)
    return checks


def test_self_check_passes_the_shipped_kernels_and_catches_a_wrong_gradient():
    from trainer.fastpath import selfcheck

    cpu = torch.device("cpu")
    good = selfcheck.run(cpu, torch.float32, cpu_checks())
    assert [c.kernel for c in good] == ["lora_linear", "lora_mlp"] and all(c.passed for c in good)
    assert all(c.error < 1e-5 for c in good)
    bad = selfcheck.run(cpu, torch.float32, cpu_checks(scaled_gradient_lora_linear))
    assert [c.kernel for c in selfcheck.failures(bad)] == ["lora_linear"]
    assert bad[0].error > 0.1 and bad[0].as_dict()["passed"] is False

    def raising(device, dtype):
        raise RuntimeError("no kernel image is available for execution on the device")

    broken = selfcheck.run(cpu, torch.float32, {"lora_linear": raising})
    assert not broken[0].passed and broken[0].note.startswith("RuntimeError: no kernel image")
    bf16 = selfcheck.run(cpu, torch.bfloat16, cpu_checks())  # the dtype runs train in: bf16 tolerance
    assert all(c.passed and c.tolerance == selfcheck.TOLERANCE[torch.bfloat16] for c in bf16)


def test_a_wrong_kernel_keeps_the_run_on_the_reference_path(monkeypatch, capsys, write_config):
    """With the environment faked as able (CPU here), a failing self-check means: warning, reference path,
    no module patched; forced 'on', the run stops; passing kernels turn the fast path on."""
    import trainer.fastpath as fastpath

    model = load(write_config, "lora")  # loaded (on CPU: reference path) before the environment is faked
    monkeypatch.setattr(fastpath, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(fastpath, "_apply_liger", lambda model, rms_norm=True: False)
    cpu = torch.device("cpu")
    decision = decide("auto", cpu, torch.float32, cpu_checks(scaled_gradient_lora_linear))
    assert not decision.enabled and decision.reason.startswith("kernel self-check failed: lora_linear off by")
    assert "WARNING: the CUDA fast path is OFF for this run" in capsys.readouterr().err
    report = apply(model, decision)
    assert not report.enabled and not enabled(model)
    assert [c["kernel"] for c in report.self_check if not c["passed"]] == ["lora_linear"]
    assert not any("forward" in m.__dict__ for m in model.modules() if hasattr(m, "lora_A"))
    with pytest.raises(FastPathUnavailable, match="performance.fast_path: on, but kernel self-check failed"):
        decide("on", cpu, torch.float32, cpu_checks(scaled_gradient_lora_linear))
    good = decide("auto", cpu, torch.float32, cpu_checks())
    assert good.enabled and good.reason == ""
    report = apply(model, good)
    assert report.enabled and report.lora_modules_fused == 14 and report.mlp_blocks_fused == 2


def test_lora_group_matches_separate_projections_in_fp32():
    """Q/K/V as one node (stacked A GEMM, dx accumulated): outputs and every gradient equal three plain
    projections', with different ranks and scales, and an output left unused."""
    from trainer.fastpath.lora_ops import lora_group

    torch.manual_seed(4)
    hidden = 24
    shapes = [(32, 4, 0.5), (8, 4, 2.0), (8, 2, 1.0)]  # (out, rank, scale)
    weights = [torch.randn(out, hidden) * 0.1 for out, _, _ in shapes]
    bias = torch.randn(8)
    loras = [
        ((torch.randn(r, hidden) * 0.1).requires_grad_(), (torch.randn(out, r) * 0.1).requires_grad_())
        for out, r, _ in shapes
    ]
    x = torch.randn(3, 5, hidden, requires_grad=True)
    bases = [BaseWeight(weights[0], None), BaseWeight(weights[1], bias), BaseWeight(weights[2], None)]
    parts = [(a, b, base, s) for (a, b), base, (_, _, s) in zip(loras, bases, shapes)]
    q, k, _unused_v = lora_group(x, *parts)
    grads_out = [torch.randn_like(q), torch.randn_like(k)]
    (q * grads_out[0]).sum().add_((k * grads_out[1]).sum()).backward()
    leaves = [x] + [t for pair in loras for t in pair]
    got = [q.detach(), k.detach()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref_q = x @ weights[0].t() + 0.5 * (x @ loras[0][0].t()) @ loras[0][1].t()
    ref_k = x @ weights[1].t() + bias + 2.0 * (x @ loras[1][0].t()) @ loras[1][1].t()
    ref_v = x @ weights[2].t() + 1.0 * (x @ loras[2][0].t()) @ loras[2][1].t()
    (ref_q * grads_out[0]).sum().add_((ref_k * grads_out[1]).sum()).add_(ref_v.sum() * 0).backward()
    want = [ref_q.detach(), ref_k.detach()] + [
        t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves
    ]
    for i, (mine, theirs) in enumerate(zip(got, want)):
        assert float((mine - theirs).abs().max()) < 1e-5, i
    assert float(loras[2][0].grad.abs().max()) == 0.0  # V unused: no gradient reaches its LoRA pair


def test_grouped_qkv_falls_back_when_the_attention_code_does_something_else(write_config):
    """K called on another tensor than Q was gets its own node (never Q's stashed output)."""
    from trainer.fastpath.patch import STASH, patch_qkv_groups

    model = load(write_config, "lora")
    patch_lora_linears(model)
    assert patch_qkv_groups(model) == 2
    attn = next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj"))
    x, other = torch.randn(1, 4, attn.q_proj.in_features), torch.randn(1, 4, attn.q_proj.in_features)
    attn.q_proj(x)
    k_other = attn.k_proj(other)
    unpatch(model)
    assert torch.allclose(k_other, attn.k_proj(other), atol=1e-6)
    assert STASH not in attn.v_proj.__dict__


def checkpointed_llama(write_config, dropout: float = 0.0, checkpointing: bool = True):
    """tiny-llama with LoRA, transformers' checkpointing on unless ``checkpointing`` is False (CPU: the fast path
    itself is refused)."""
    from trainer.model.loading import load_for_training

    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(REPO / "configs" / "tiny-llama")},
                "training": {"method": "lora"},
                "lora": {"dropout": 0.0, "target_modules": ALL_LINEAR},
                "memory": {"gradient_checkpointing": checkpointing},
            }
        )
    )
    model = load_for_training(cfg, torch.device("cpu")).model
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    model.train()
    return model


def checkpoint_grads(model, ids, autocast: bool = False, seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for every variant
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout,autocast", [(0.0, False), (0.3, False), (0.0, True)])
def test_offloaded_checkpointing_gives_the_gradients_of_plain_checkpointing(write_config, dropout, autocast):
    """The recompute replays the forward's RNG (dropout masks) and autocast state, and the LoRA gradients of
    the first layer arrive although its input (a frozen embedding's output) needs no gradient: the hook
    transformers adds to make it need one is removed (it kept that output and its gradient on the device)."""
    from trainer.fastpath.offload import offload_checkpointed_layers

    model = checkpointed_llama(write_config, dropout)
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, out: embedded.append(out.requires_grad))
    ids = torch.randint(3, 1024, (2, 24))
    ref_loss, ref_grads = checkpoint_grads(model, ids, autocast)
    assert offload_checkpointed_layers(model) == 2
    loss, grads = checkpoint_grads(model, ids, autocast)
    # transformers' hook made the frozen embedding's output need a gradient; offloaded, nothing needs one
    assert embedded == [True, False]
    assert float(loss) == float(ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < (1e-2 if autocast else 1e-6), name
    if dropout:  # the masks matter here: other masks give other gradients, so the replay above was needed
        _, other = checkpoint_grads(model, ids, autocast, seed=2)
        assert max(rel_err(other[n], ref_grads[n]) for n in grads) > 1e-3


def test_offloader_prefetches_in_backward_order_and_forgets_abandoned_forwards(monkeypatch):
    from trainer.fastpath import offload

    prefetched = []
    monkeypatch.setattr(offload._Slot, "prefetch", lambda self: prefetched.append(float(self.host[0])))
    offloader = offload.Offloader()
    slots = [offloader.push(torch.full((2,), float(i))) for i in range(3)]
    assert float(offloader.take(slots[2])[0]) == 2.0 and prefetched == [1.0]
    assert float(offloader.take(slots[1])[0]) == 1.0 and prefetched == [1.0, 0.0]
    assert len(offloader.slots) == 1
    del slots  # a forward whose backward never ran (an OOM mid-step): its slots die with its graph
    kept = offloader.push(torch.zeros(2))
    assert [ref() for ref in offloader.slots] == [kept]


def test_offloader_keeps_only_the_newest_input_waiting_on_the_device(monkeypatch):
    """Each input is held on the device until the compute stream is ordered after its copy to the host
    (``settle``): pushing a layer's input settles the ones before it, so a forward the host runs ahead of
    (replayed layers) never holds every layer's input. The stand-in slot records what the GPU one
    would do."""
    from trainer.fastpath import offload

    class Slot:
        def __init__(self, hidden, stream):
            self.host, self.source, self.settled = hidden, hidden, False

        def settle(self):
            self.settled, self.source = True, None

        def prefetch(self):
            pass

        def load(self):
            return self.host

    monkeypatch.setattr(offload, "_Slot", Slot)
    offloader = offload.Offloader()
    slots = [offloader.push(torch.full((2,), float(i))) for i in range(5)]
    assert [s.settled for s in slots] == [True, True, True, True, False]
    assert float(offloader.take(slots[4])[0]) == 4.0


def test_offloading_follows_the_memory_setting(write_config, monkeypatch):
    """memory.offload_checkpoints reaches the fast path, for LoRA with checkpointing only (not under FSDP:
    docs/fsdp.md)."""
    import trainer.fastpath as fastpath
    from trainer.model import loading

    seen = []
    real_apply = fastpath.apply
    monkeypatch.setattr(
        loading.fastpath, "apply", lambda m, d, **kw: seen.append(kw) or real_apply(m, d, **kw)
    )
    for memory, expected in (
        ({"gradient_checkpointing": True}, True),
        ({"gradient_checkpointing": True, "offload_checkpoints": False}, False),
        ({"gradient_checkpointing": False}, False),
    ):
        cfg = load_config(
            write_config(
                {
                    "model": {"name_or_path": str(REPO / "configs" / "tiny-llama")},
                    "training": {"method": "lora"},
                    "memory": memory,
                }
            )
        )
        loading.load_for_training(cfg, torch.device("cpu"))
        assert seen[-1]["offload"] == expected, memory
        assert seen[-1]["graphs_off"] == "not a CUDA device", memory


def test_offloaded_checkpointing_hands_a_tuple_returning_layer_to_torchs_own():
    """A layer returning more than its hidden states (e.g. attention weights) cannot be routed: it gets
    PyTorch's checkpointing, with the same gradients, from its first call on."""
    from trainer.fastpath.offload import OffloadedCheckpoint

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def run(hidden):
        return torch.tanh(layer(hidden)), None

    run(x)[0].sum().backward()
    expected = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = None
    func = OffloadedCheckpoint()
    out, extra = func(run, x)
    out.sum().backward()
    assert func.plain and extra is None
    assert torch.allclose(x.grad, expected[0]) and torch.allclose(layer.weight.grad, expected[1])
    assert func.offloader.slots == []
