"""The GLA/Mamba runs' fast path (trainer/model/loading.py ``family_fast_path``, trainer/fastpath
``apply_to_family``) and Mamba-2's own swap onto fla's gated norm (trainer/families/mamba_fast.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.families.helpers import family_config
from trainer import fastpath
from trainer.config import load_config
from trainer.data.dataset import Sequence, collate
from trainer.families import mamba, mamba_fast
from trainer.families.gla import GLA
from trainer.families.mamba import MAMBA
from trainer.kernelcheck import KernelCheck
from trainer.model import loading

ROOT = Path(__file__).resolve().parents[2]


def test_gated_norm_kernel_matches_the_mixer_and_its_check_catches_a_wrong_kernel():
    """fla's Triton kernels in Triton's interpreter: the shipped check in fp32 and bf16, a kernel with the
    norm before the gate (what mamba_ssm's other mode computes) failing it, and a transformers Mamba-2 mixer
    (two groups) with its norm swapped by ``fast_modules`` against the same mixer unswapped."""
    pytest.importorskip("fla")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/families/mamba_fast_check.py")],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    tolerance = fastpath.selfcheck.TOLERANCE
    assert report["fp32-groups2"] < 1e-5 and report["fp32-groups1"] < 1e-5, report
    assert report["bf16-groups2"] < tolerance[torch.bfloat16], report
    assert report["wrong-kernel"] > 100 * tolerance[torch.float32], report
    assert report["mixer"]["swapped"] == {mamba_fast.GATED_NORM: 1}
    assert report["mixer"]["max_rel"] < 1e-5, report


def test_gated_norm_reference_is_transformers_norm():
    """The check's reference is transformers' own grouped norm (and an older, ungrouped one is one group)."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    norm = MambaRMSNormGated(16, group_size=8)
    torch.nn.init.normal_(norm.weight)
    x, gate = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    expected = norm(x, gate)
    group = mamba_fast.group_size(norm)
    assert group == 8
    torch.testing.assert_close(mamba_fast.gated_norm_reference(x, gate, norm.weight, 1e-6, group), expected)
    assert mamba_fast.group_size(types.SimpleNamespace(weight=torch.ones(16))) == 16


def _tiny_mamba2(tmp_path, extra=None):
    cfg = load_config(
        family_config(tmp_path, "tiny-mamba2", ["in_proj"], {"lora": {"dropout": 0.0}, **(extra or {})})
    )
    return cfg, loading.load_for_training(cfg, torch.device("cpu"))


def test_swap_only_on_fla_and_only_mamba2_offers_its_check(tmp_path):
    from transformers import Mamba2Config, MambaConfig

    _, loaded = _tiny_mamba2(tmp_path)
    norms = [m for m in loaded.model.modules() if type(m).__name__ == "MambaRMSNormGated"]
    assert norms and mamba.fast_modules(loaded.model, mamba.KERNEL_REFERENCE) == {}
    assert all("forward" not in vars(m) for m in norms)  # untouched off the fla path
    assert set(mamba.fast_checks(Mamba2Config(), mamba.KERNEL_FLA)) == {mamba_fast.GATED_NORM}
    assert mamba.fast_checks(Mamba2Config(), mamba.KERNEL_MAMBA_SSM) == {}
    assert mamba.fast_checks(MambaConfig(), mamba.KERNEL_FLA) == {}
    assert MAMBA.fast_path and not GLA.fast_path


def test_a_mask_without_padding_is_left_out_of_mamba_inputs():
    rows = [Sequence(list(range(4, 20)), list(range(4, 20)), list(range(16))) for _ in range(2)]
    assert set(mamba.model_inputs(collate(rows, 0))) == {"input_ids"}
    rows[1] = Sequence(list(range(4, 12)), list(range(4, 12)), list(range(8)))
    assert set(mamba.model_inputs(collate(rows, 0))) == {"input_ids", "attention_mask"}


def _choice(passed=True):
    return types.SimpleNamespace(checks=(KernelCheck("fla_ssd_scan", 0.0 if passed else 1.0, 0.03),))


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_family_fast_path_rides_on_the_familys_checked_kernels(tmp_path, monkeypatch, mode):
    """On a CUDA fast kernel path the fast path's own checks (LoRA, the loss, the family's swap) run after the
    family's; on a reference path, or for GLA, the run stays off it ('on' there is an error, as for causal)."""
    from transformers import Mamba2Config

    cfg = load_config(
        family_config(tmp_path, "tiny-mamba2", ["in_proj"], {"performance": {"fast_path": mode}})
    )
    asked = {}

    def decide(mode_, device, dtype, checks):
        asked.update(checks)
        return fastpath.Decision(True, "", (KernelCheck("lora_linear", 0.0, 0.03),))

    monkeypatch.setattr(fastpath, "decide", decide)
    config = Mamba2Config()
    fast = loading.family_fast_path(cfg, MAMBA, config, mamba.KERNEL_FLA, "cuda", torch.bfloat16, _choice())
    assert fast.enabled
    assert [c.kernel for c in fast.checks] == ["fla_ssd_scan", "lora_linear"]
    assert set(asked) == {"fused_cross_entropy", "lora_linear", mamba_fast.GATED_NORM}

    if mode == "on":
        with pytest.raises(fastpath.FastPathUnavailable, match="gla family runs its own kernels"):
            loading.family_fast_path(cfg, GLA, config, "fla-triton", "cuda", torch.bfloat16, _choice())
        with pytest.raises(fastpath.FastPathUnavailable, match="reference kernels"):
            loading.family_fast_path(
                cfg, MAMBA, config, mamba.KERNEL_REFERENCE, "cuda", torch.bfloat16, _choice()
            )
    else:
        gla = loading.family_fast_path(cfg, GLA, config, "fla-triton", "cuda", torch.bfloat16, _choice())
        assert not gla.enabled and "gla family runs its own kernels" in gla.reason
        off = loading.family_fast_path(cfg, MAMBA, config, mamba.KERNEL_FLA, "cpu", torch.bfloat16, _choice())
        assert not off.enabled and "reference kernels here" in off.reason


def test_family_fast_path_off_and_qlora_checks(tmp_path, monkeypatch):
    from transformers import Mamba2Config

    cfg = load_config(
        family_config(tmp_path, "tiny-mamba2", ["in_proj"], {"performance": {"fast_path": "off"}})
    )
    off = loading.family_fast_path(
        cfg, MAMBA, Mamba2Config(), mamba.KERNEL_FLA, "cuda", torch.bfloat16, _choice()
    )
    assert not off.enabled and off.reason == "performance.fast_path: off" and off.checks == _choice().checks
    assert set(fastpath.family_checks("qlora")) == {"fused_cross_entropy", "lora_linear", "lora_linear_nf4"}
    assert set(fastpath.family_checks("full")) == {"fused_cross_entropy_trainable_head"}  # Liger's own node


def test_apply_to_family_fuses_lora_and_loss_and_calls_the_familys_swap(tmp_path):
    """On a loaded tiny Mamba-2 (CPU, so the swap is a stand-in): every in_proj LoRA as one node, the block
    norms on F.rms_norm, the fused loss marked, the family's swap reported; the LoRA nodes give PEFT's output."""
    _, loaded = _tiny_mamba2(tmp_path)
    model = loaded.model
    x = torch.randn(2, 7, model.config.hidden_size)
    in_proj = next(m for n, m in model.named_modules() if n.endswith("mixer.in_proj"))
    torch.nn.init.normal_(in_proj.lora_B["default"].weight)
    expected = in_proj(x)
    off = fastpath.apply_to_family(model, fastpath.Decision(False, "why"), lambda m: {"x": 1})
    assert not off.enabled and off.reason == "why" and not fastpath.enabled(model)
    report = fastpath.apply_to_family(model, fastpath.Decision(True), lambda m: {"swap": 3})
    layers = model.config.num_hidden_layers
    assert report.enabled and report.lora_modules_fused == layers and report.lora_modules_reference == 0
    assert report.family_modules == {"swap": 3} and report.fused_loss and fastpath.enabled(model)
    assert report.rms_norm == f"torch ({layers + 1} modules)"  # each block's norm and the final one
    torch.testing.assert_close(in_proj(x), expected)


@pytest.mark.parametrize("dtype, mixed_precision", [("fp32", "no"), ("bf16", "no"), ("fp32", "bf16")])
def test_mamba_loss_runs_chunked_and_equals_the_full_cross_entropy(tmp_path, dtype, mixed_precision):
    """Mamba's logits are its head on the final hidden states, handed back in fp32: the chunked loss casts them
    to the head's dtype where no autocast does (bf16 weights without mixed precision, as a GPU's tiny runs)."""
    from tests.families.test_mamba import _Accelerator
    from trainer.training.step import FullCrossEntropy, kernels_for

    extra = {"model": {"dtype": dtype}, "training": {"mixed_precision": mixed_precision}}
    _, loaded = _tiny_mamba2(tmp_path, extra)
    assert loaded.report["chunked_loss"] is True
    model = loaded.model.train()
    kernels = kernels_for(model, MAMBA)
    assert kernels.name == "reference-chunked-ce"
    rows = [Sequence(list(range(4, 36)), list(range(4, 36)), list(range(32))) for _ in range(2)]
    batch = collate(rows, 0)
    accelerator = _Accelerator(mixed_precision)
    chunked, _ = kernels.loss(model, batch, accelerator)
    full, _ = FullCrossEntropy(MAMBA.model_inputs)(model, batch, accelerator)
    tolerance = 1e-5 if dtype == "fp32" and mixed_precision == "no" else 2e-2
    torch.testing.assert_close(chunked, full, rtol=tolerance, atol=0)


@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-mamba2"])
def test_a_mamba_step_on_the_family_fast_path_equals_the_reference(tmp_path, monkeypatch, model):
    """Mamba-1 (LoRA on in_proj and x_proj, whose output feeds the scan's dt, B and C) and Mamba-2 through the
    fast path's LoRA nodes, F.rms_norm and the head-bypassed loss (here its fp32 stand-in, the chunked loss:
    Liger's kernel needs a GPU) give the reference path's loss and gradients, in fp32, B drawn nonzero."""
    import copy

    from tests.families.test_mamba import _Accelerator
    from trainer.model import chunked_loss
    from trainer.training.step import kernels_for

    monkeypatch.setattr(fastpath, "fused_cross_entropy", chunked_loss.chunked_cross_entropy)
    targets = ["in_proj", "x_proj"] if model == "tiny-mamba" else ["in_proj"]
    cfg = load_config(family_config(tmp_path, model, targets, {"lora": {"dropout": 0.0}}))
    reference = loading.load_for_training(cfg, torch.device("cpu")).model.train()
    torch.manual_seed(0)
    for name, param in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    fast = copy.deepcopy(reference)
    report = fastpath.apply_to_family(fast, fastpath.Decision(True), lambda m: {})
    assert report.lora_modules_fused == len(targets) * reference.config.num_hidden_layers
    assert kernels_for(fast, MAMBA).name == "fast-path"
    rows = [Sequence(list(range(4, 36)), list(range(4, 36)), list(range(32))) for _ in range(2)]
    batch = collate(rows, 0)
    results = []
    for m in (reference, fast):
        m.zero_grad(set_to_none=True)
        ce_sum, _ = kernels_for(m, MAMBA).loss(m, batch, _Accelerator("no"))
        ce_sum.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad])
        results.append((ce_sum.detach(), grads))
    (loss_ref, grads_ref), (loss_fast, grads_fast) = results
    torch.testing.assert_close(loss_fast, loss_ref, rtol=1e-5, atol=0)
    assert float((grads_fast - grads_ref).norm() / grads_ref.norm()) < 1e-5


@pytest.mark.parametrize(
    "model, expected",
    [("tiny-gla", "the gla family runs its own kernels"), ("tiny-mamba2", "reference kernels")],
)
def test_fast_path_on_for_a_family_run_that_cannot_take_it_is_exit_2(tmp_path, model, expected):
    """``performance.fast_path: on`` insists: a GLA run (never on it) or a Mamba run on its reference kernels
    (a CPU) stops before training with one line naming the key, as a causal run on a CPU does."""
    from tests.helpers import run_trainer

    if model == "tiny-gla":
        pytest.importorskip("fla")
    config = family_config(tmp_path, model, ["q_proj"] if model == "tiny-gla" else ["in_proj"],
                           {"performance": {"fast_path": "on"}})  # fmt: skip
    result = run_trainer("train", "--config", str(config))
    assert result.returncode == 2, result.stderr[-2000:]
    line = next(x for x in result.stderr.splitlines() if "performance.fast_path: on, but" in x)
    assert expected in line
