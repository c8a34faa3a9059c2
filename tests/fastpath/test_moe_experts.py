"""4-bit MoE experts through one dequantization and grouped GEMMs (trainer/fastpath/moe_experts.py), checked in
fp32 against transformers' eager per-expert loop on the same 4-bit weights: outputs, the input gradient and the
routing weights' gradient."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers import REPO

pytest.importorskip("bitsandbytes")

from trainer.fastpath.moe_experts import IMPLEMENTATION, patch_quantized_experts  # noqa: E402
from trainer.moe_quant import quantize_fused_experts  # noqa: E402

GLM_TINY = dict(  # experts small enough that the second-level scale blocks straddle experts (fp32 scales kept)
    model_type="glm4_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, n_group=1, topk_group=1,
)  # fmt: skip


def tiny_moe(name: str):
    torch.manual_seed(0)
    if name == "qwen2_moe":
        config = AutoConfig.from_pretrained(REPO / "configs" / "tiny-moe")
    else:
        config = AutoConfig.for_model(**GLM_TINY)
    model = AutoModelForCausalLM.from_config(config)
    assert quantize_fused_experts(model, "nf4", True) > 0
    return model


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


def run_experts(experts, hidden, index, weights):
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = experts(hidden, index, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), hidden.grad, weights.grad


@pytest.mark.parametrize("name", ["qwen2_moe", "glm4_moe"])
def test_grouped_4bit_experts_equal_the_eager_loop(name):
    model = tiny_moe(name)
    experts = experts_modules(model)[0]
    hidden_size = experts.gate_up_proj.shape[2]
    tokens, top_k = 37, 2
    hidden = torch.randn(tokens, hidden_size)
    # two distinct experts per token, never the last one: one expert gets no tokens (an empty group)
    index = torch.stack([torch.randperm(experts.num_experts - 1)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    expert_3 = experts.gate_up_proj[3].clone()
    eager = run_experts(experts, hidden, index, weights)

    assert patch_quantized_experts(model) == len(experts_modules(model))
    assert experts.config._experts_implementation == IMPLEMENTATION
    grouped = run_experts(experts, hidden, index, weights)
    for name_, a, b in zip(("output", "input grad", "routing-weight grad"), eager, grouped, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"{name_}: {(a - b).abs().max()}"
    # Each expert's own storage became a view into the packed tensor: still dequantizes the same, no copy kept.
    assert torch.equal(experts.gate_up_proj[3], expert_3)
    packed = experts._kit_packed_gate_up.packed
    assert experts.gate_up_proj.packed_3.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


def test_grouped_experts_train_the_model_like_the_eager_loop():
    """A whole model's loss and the attention LoRA-free gradients (router, shared parts) agree after patching."""
    model = tiny_moe("glm4_moe")
    for param in model.parameters():
        param.requires_grad_(param.dtype.is_floating_point)
    ids = torch.randint(0, 256, (2, 24))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads()
    patch_quantized_experts(model)
    grouped_loss, grouped_grads = loss_and_grads()
    assert torch.allclose(eager_loss, grouped_loss, atol=1e-6)
    assert eager_grads.keys() == grouped_grads.keys() and any(
        "router" in n or "gate" in n for n in eager_grads
    )
    for name, grad in eager_grads.items():
        assert torch.allclose(grad, grouped_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_experts_stored_as_float_for_fsdp_are_grouped_from_the_parameters_of_each_call(storage):
    """FSDP's floating storage (quantization storage under FSDP) is sharded and gathered per call, so it is not
    packed once: the grouped path concatenates the experts' parameters as they are at the call. Same outputs
    and gradients as the eager loop; and when the parameters are swapped for other tensors of the same bytes
    (as FSDP swaps in its gathered copies), the grouped path reads the new ones."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-moe"))
    quantize_fused_experts(model, "nf4", True, storage=storage)
    experts = experts_modules(model)[0]
    hidden_size = experts.gate_up_proj.shape[2]
    hidden = torch.randn(29, hidden_size)
    index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(29)])
    weights = torch.rand(29, 2)
    eager = run_experts(experts, hidden, index, weights)

    assert patch_quantized_experts(model) == len(experts_modules(model))
    assert (
        experts._kit_packed_gate_up.packed is None
        and experts._kit_packed_gate_up.live is experts.gate_up_proj
    )
    grouped = run_experts(experts, hidden, index, weights)
    for name_, a, b in zip(("output", "input grad", "routing-weight grad"), eager, grouped, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"{name_}: {(a - b).abs().max()}"

    for module in (experts.gate_up_proj, experts.down_proj):  # FSDP's swap: new tensors, the same bytes
        for name, param in list(module.named_parameters()):
            module._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
    swapped = experts.gate_up_proj.packed_1
    again = run_experts(experts, hidden, index, weights)
    assert all(torch.equal(a, b) for a, b in zip(grouped, again, strict=True))
    swapped.data.zero_()  # expert 1's bytes now read as other values: the output moves
    assert not torch.allclose(run_experts(experts, hidden, index, weights)[0], again[0])


def test_self_check_passes_grouped_experts_and_catches_a_wrong_layout():
    """The start-up check of the grouped 4-bit experts: the shipped function passes; one that multiplies the
    experts in the wrong order (a layout mistake) is caught."""
    import functools

    from trainer.fastpath import selfcheck
    from trainer.fastpath.moe_experts import GroupedFrozenLinear

    def shuffled(x, packed, offsets):
        original = packed.dequantize
        packed.dequantize = lambda: original().flip(0)
        return GroupedFrozenLinear.apply(x, packed, offsets)

    cpu = torch.device("cpu")
    good = selfcheck.run(cpu, torch.float32, {"grouped_4bit_experts": selfcheck.check_grouped_4bit_experts})
    assert not selfcheck.failures(good), good
    wrong = functools.partial(selfcheck.check_grouped_4bit_experts, kernel=shuffled)
    bad = selfcheck.run(cpu, torch.float32, {"grouped_4bit_experts": wrong})
    assert [c.kernel for c in selfcheck.failures(bad)] == ["grouped_4bit_experts"]


def test_fast_path_apply_groups_the_kits_qlora_moe_experts(monkeypatch, write_config):
    """Loaded as the kit loads QLoRA MoE (experts quantized, LoRA on attention), ``fastpath.apply`` reports the
    experts modules it grouped, and the loss and LoRA gradients stay those of the eager loop."""
    import trainer.fastpath as fastpath
    from trainer.config import load_config
    from trainer.model.loading import load_for_training

    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(REPO / "configs" / "tiny-moe")},
                "training": {"method": "qlora"},
                "lora": {"dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                "quantization": {"compute_dtype": "fp32"},
            }
        )
    )
    model = load_for_training(cfg, torch.device("cpu")).model
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    ids = torch.randint(3, 1024, (2, 16))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eager_loss, eager_grads = loss_and_grads()
    monkeypatch.setattr(fastpath, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(fastpath, "_apply_liger", lambda model, rms_norm=True: False)
    decision = fastpath.decide("auto", torch.device("cpu"), torch.float32, {})
    report = fastpath.apply(model, decision)
    assert report.enabled and report.moe_experts_grouped == 2
    grouped_loss, grouped_grads = loss_and_grads()
    assert torch.allclose(eager_loss, grouped_loss, atol=1e-5)
    for name, grad in eager_grads.items():
        assert torch.allclose(grad, grouped_grads[name], atol=1e-5, rtol=1e-4), name
