"""QLoRA through bitsandbytes' CPU backend: real NF4 layers, and LoRA gradients that stay right after an
evaluation (on AVX512-BF16 CPUs the first no-grad forward used to break them silently)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO, run_trainer
from trainer.config import load_config
from trainer.data.dataset import collate, pack
from trainer.training.step import forward_loss

bnb = pytest.importorskip("bitsandbytes")


class CpuAccelerator:
    """The two things forward_loss needs from accelerate, without creating a process group."""

    device = torch.device("cpu")

    @staticmethod
    def autocast():
        import contextlib

        return contextlib.nullcontext()


def qlora_config(write_config, model="tiny-llama", **extra):
    cfg = {
        "model": {"name_or_path": str(REPO / "configs" / model)},
        "training": {"method": "qlora"},
        "lora": {"dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return load_config(write_config(cfg))


def lora_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    ce_sum, _ = forward_loss(model, batch, CpuAccelerator())
    ce_sum.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_nf4_layers_and_gradients_after_evaluation_match(write_config):
    from trainer.model.loading import load_for_training

    cfg = qlora_config(write_config)
    model = load_for_training(cfg, torch.device("cpu")).model
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 7  # every linear of both layers; lm_head is skipped
    weight = four_bit[0].weight
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quant
    assert all(m.support_avx512bf16_for_cpu is False for m in four_bit)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would hide wrong gradients in A
            param.data.normal_(0, 0.05)
    ids = torch.randint(3, 1024, (40,)).tolist()
    batch = collate(pack([(ids, ids), (ids[:20], ids[:20])], 32, 0), 0)
    model.train()
    reference = lora_gradients(model, batch)
    model.eval()
    with torch.no_grad():  # an evaluation or generate() between training steps
        forward_loss(model, batch, CpuAccelerator())
    model.train()
    after = lora_gradients(model, batch)
    assert reference.keys() == after.keys() and len(reference) > 0
    for name in reference:
        assert torch.allclose(reference[name], after[name], rtol=1e-4, atol=1e-6), name
    assert any(float(g.abs().sum()) > 0 for n, g in reference.items() if "lora_A" in n)


@pytest.mark.slow
def test_qlora_moe_without_expert_quantization_says_so(write_config, tmp_path):
    config = write_config(
        {
            "training": {"method": "qlora", "max_steps": 2},
            "quantization": {"quantize_experts": False},
            "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        }
    )
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fused MoE expert weights are NOT 4-bit quantized" in result.stdout
    events = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    report = next(e for e in events if e["event"] == "model_report")
    assert report["method"] == "qlora" and report["quantized_params"] > 0
    assert (
        report["unquantized_expert_bytes"] == 2 * (8 * 256 * 128 + 8 * 128 * 128) * 4
    )  # fp32 after k-bit prep


@pytest.mark.slow
def test_qlora_moe_quantizes_fused_experts_and_trains(write_config, tmp_path):
    config = write_config(
        {
            "training": {"method": "qlora", "max_steps": 4},
            "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        }
    )
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NOT 4-bit quantized" not in result.stdout
    events = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    report = next(e for e in events if e["event"] == "model_report")
    assert report["unquantized_expert_bytes"] == 0
    expert_params = 2 * (8 * 256 * 128 + 8 * 128 * 128)
    assert report["quantized_params"] >= expert_params
    records = (tmp_path / "run" / "logs" / "training_log.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in records]
    assert len(losses) == 4 and all(isinstance(x, float) for x in losses)


def test_quantized_experts_compute_with_dequantized_weights():
    """The experts' own forward, run on 4-bit storage, equals running it on the dequantized weights."""
    import bitsandbytes.functional as bnbf
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.moe_quant import QuantizedExpertWeights, quantize_fused_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-moe"))
    experts = model.model.layers[0].mlp.experts
    original = experts.gate_up_proj.detach().clone()
    hidden = torch.randn(10, 128)
    top_k_index = torch.randint(0, 8, (10, 2))
    weights = torch.rand(10, 2)
    assert quantize_fused_experts(model, "nf4", True) == 4
    assert isinstance(experts.gate_up_proj, QuantizedExpertWeights)
    assert experts.gate_up_proj.stored_bytes() < original.numel() * 4 / 6
    quantized_out = experts(hidden, top_k_index, weights)
    dequantized = torch.stack([experts.gate_up_proj[i] for i in range(8)])
    down = torch.stack([experts.down_proj[i] for i in range(8)])
    reference = torch.nn.Module()
    reference.__class__ = type(experts)
    reference.__dict__.update({k: v for k, v in experts.__dict__.items() if k not in ("_modules",)})
    reference._modules = {"act_fn": experts.act_fn}
    reference._parameters = {
        "gate_up_proj": torch.nn.Parameter(dequantized),
        "down_proj": torch.nn.Parameter(down),
    }
    assert torch.allclose(quantized_out, reference(hidden, top_k_index, weights), atol=1e-6)
    q, state = bnbf.quantize_4bit(
        original[3].contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    assert torch.equal(experts.gate_up_proj[3], bnbf.dequantize_4bit(q, state))


def test_qlora_keeps_16bit_weights_where_fused_kernels_train():
    """QLoRA's fp32 upcast stays on the reference paths (CPU, torch-reference) and is skipped where the
    causal fast path or a family's own GPU kernels (mamba_ssm, fla's Triton) run, as their LoRA runs do."""
    from transformers import AutoConfig

    from trainer.families import family_for
    from trainer.fastpath import Decision
    from trainer.model.loading import keeps_16bit_under_qlora

    pytest.importorskip("fla")  # registers the gla config with transformers

    off, on = Decision(False, "off"), Decision(True)
    mamba2 = AutoConfig.from_pretrained(REPO / "configs" / "tiny-mamba2")
    gla = AutoConfig.from_pretrained(REPO / "configs" / "tiny-gla")
    causal = AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert keeps_16bit_under_qlora(family_for("mamba2"), mamba2, "mamba_ssm", cuda, off)
    assert keeps_16bit_under_qlora(family_for("gla"), gla, "fla-triton", cuda, off)
    assert not keeps_16bit_under_qlora(family_for("mamba2"), mamba2, "torch-reference", cuda, off)
    assert not keeps_16bit_under_qlora(family_for("gla"), gla, "fla-naive-torch", cuda, off)
    assert not keeps_16bit_under_qlora(family_for("mamba2"), mamba2, "mamba_ssm", cpu, off)
    assert not keeps_16bit_under_qlora(family_for("llama"), causal, "transformers", cuda, off)
    assert keeps_16bit_under_qlora(family_for("llama"), causal, "transformers", cuda, on)


@pytest.mark.parametrize("upcast, norm_dtype", [("auto", torch.float32), ("off", torch.bfloat16)])
def test_quantization_upcast_decides_the_16bit_parameters_dtype(write_config, upcast, norm_dtype):
    """On the reference path (CPU) auto upcasts the norms and head to fp32, as peft's preparation does; off keeps
    them in the model's bf16, the fast path's precision (a like-for-like reference for its loss checks)."""
    from trainer.model.loading import load_for_training

    cfg = qlora_config(write_config, quantization={"upcast": upcast})
    cfg.model.dtype = "bf16"
    model = load_for_training(cfg, torch.device("cpu")).model
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    head = model.get_output_embeddings()
    head = getattr(head, "base_layer", head)
    assert norms and {p.dtype for p in norms} == {norm_dtype}
    assert head.weight.dtype == norm_dtype


def test_qlora_upcast_follows_the_setting_and_auto_the_path(write_config):
    from trainer.model.loading import qlora_upcast

    def upcast(mode, keeps_16bit):
        cfg = qlora_config(write_config, quantization={"upcast": mode}, performance={"fast_path": "off"})
        return qlora_upcast(cfg, keeps_16bit)

    assert upcast("auto", False) and not upcast("auto", True)
    assert upcast("on", False) and upcast("on", True)
    assert not upcast("off", False) and not upcast("off", True)


@pytest.mark.parametrize(
    "extra, said",
    [
        ({"training": {"distributed": "fsdp"}, "performance": {"fast_path": "off"}}, "FSDP casts"),
        ({}, "performance.fast_path: off"),  # fast_path auto
    ],
)
def test_quantization_upcast_on_where_it_cannot_run_is_a_one_line_error(write_config, extra, said):
    extra = {**extra, "training": {"method": "qlora", **extra.get("training", {})}}
    result = run_trainer(
        "check-config", "--config", str(write_config({**extra, "quantization": {"upcast": "on"}}))
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "quantization.upcast: on" in line]
    assert len(lines) == 1 and said in lines[0], result.stderr[-2000:]
