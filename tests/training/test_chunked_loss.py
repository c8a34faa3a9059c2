"""Chunked cross-entropy gives the loss and gradients of the full-logits loss, without the full logits."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import REPO
from trainer.config import load_config
from trainer.data.dataset import collate, pack
from trainer.model import chunked_loss
from trainer.model.loading import load_for_training
from trainer.training.step import forward_loss


class CpuAccelerator:
    device = torch.device("cpu")

    @staticmethod
    def autocast():
        import contextlib

        return contextlib.nullcontext()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_dir", ["tiny-llama", "tiny-moe"])
def test_chunked_equals_full(write_config, model_dir, monkeypatch):
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(REPO / "configs" / model_dir)},
                "lora": {"dropout": 0.0, "target_modules": ["q_proj", "v_proj", "lm_head"]},
            }
        )
    )
    model = load_for_training(cfg, torch.device("cpu")).model
    assert chunked_loss.enabled(model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)  # non-zero B, so every LoRA gradient is exercised
    torch.manual_seed(0)
    ids = torch.randint(3, 1024, (300,)).tolist()
    batch = collate(pack([(ids, ids), (ids[:90], ids[:90])], 128, 0), 0)
    monkeypatch.setattr(chunked_loss, "CHUNK_TOKENS", 100)  # several chunks, one ragged

    model.zero_grad()
    chunked, _ = forward_loss(model, batch, CpuAccelerator())
    chunked.backward()
    chunked_grads = grads(model)

    chunked_loss.enable(model, False)
    model.zero_grad()
    full, _ = forward_loss(model, batch, CpuAccelerator())
    full.backward()
    full_grads = grads(model)

    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    assert chunked_grads.keys() == full_grads.keys() and any("lm_head" in n for n in full_grads)
    for name, grad in full_grads.items():
        assert torch.allclose(chunked_grads[name], grad, rtol=1e-4, atol=1e-6), name
    head = chunked_loss.output_head(model)
    assert "forward" not in head.__dict__  # the bypass is undone after each forward


def test_only_plain_head_architectures_are_chunked():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama"))
    assert chunked_loss.enable(model, True) is True
    model.config.model_type = "gemma2"  # soft-caps logits after the head: must not be chunked
    assert chunked_loss.enable(model, True) is False
