"""The GLA and Mamba families' start-up kernel self-check and ``model.kernel_path``, on a CPU.

The kernels checked are CUDA kernels, so the GPU is faked the way tests/fastpath does it: the check is
allowed to run on the CPU (``kernel_choice.self_check_runs_on``), the fast path is made to look usable, and
the "fast kernels" are their own torch references (a right kernel) or those with a gradient scaled by 1.5
(a wrong one: right forward, wrong backward, what a forward-only check would miss).
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

from tests.families.helpers import cli, error_line, events, family_config
from tests.helpers import REPO
from trainer import kernelcheck
from trainer.config import load_config
from trainer.model import kernel_choice

CPU = torch.device("cpu")
GLA_TARGETS = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "lm_head"]


def scaled_gradient(op):
    """``op`` with its output's gradient scaled by 1.5 (outputs unchanged)."""

    @functools.wraps(op)
    def wrong(*args, **kwargs):
        out = op(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        first = first + 0.5 * (first - first.detach())
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return wrong


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(kernelcheck, "_CACHE", {})
    monkeypatch.setattr(kernel_choice, "self_check_runs_on", lambda device: True)


@pytest.fixture
def gla_gpu(monkeypatch, fresh_cache):
    """fla's Triton kernels stand in for by their torch references, and the Triton path looks usable."""
    pytest.importorskip("fla.models", reason="the gla family needs flash-linear-attention")
    import fla.layers.gla as layer
    import fla.modules.activations as activations
    import fla.ops.gla as ops
    from fla.modules import FusedRMSNormGated, RMSNorm

    from trainer.families import gla

    def gated(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        return (gla._torch_rms_norm(self, x).float() * F.silu(g.float())).to(x.dtype)

    monkeypatch.setattr(gla, "_triton_runs", lambda: True)
    # Products in bf16, as on a real GPU, so the layer runs chunk_gla (an fp32 run takes the recurrent kernel:
    # tests/families/test_gla.py).
    monkeypatch.setattr(gla, "computes_in_fp32", lambda cfg: False)
    for name in gla.GLA_OPS:  # whatever a load binds there is undone after the test
        monkeypatch.setattr(layer, name, getattr(layer, name))
    monkeypatch.setattr(ops, "chunk_gla", gla.naive_gla)
    monkeypatch.setattr(ops, "fused_recurrent_gla", gla.naive_gla)
    monkeypatch.setattr(RMSNorm, "forward", gla._torch_rms_norm)
    monkeypatch.setattr(FusedRMSNormGated, "forward", gated)
    monkeypatch.setattr(activations, "swiglu_linear", lambda x, y, w, b: F.linear(F.silu(x) * y, w, b))
    return ops


def gla_config():
    from fla.models import GLAConfig

    return GLAConfig.from_pretrained(REPO / "configs" / "tiny-gla")


def test_gla_self_check_passes_right_kernels_and_catches_a_wrong_gradient(gla_gpu):
    from trainer.families import gla_checks

    checks = gla_checks.checks(gla_config())  # tiny-gla: fuse_norm and fuse_swiglu on
    assert list(checks) == [
        "chunk_gla",
        "chunk_gla_rows",
        "fused_recurrent_gla",
        "rms_norm",
        "fused_rms_norm_gated",
        "swiglu_linear",
    ]
    tolerance = kernelcheck.TRITON_TOLERANCE
    fp32 = kernelcheck.run(CPU, torch.float32, checks, tolerance=tolerance)
    assert all(c.passed and c.error < 1e-6 and c.tolerance == 1e-2 for c in fp32)
    bf16 = kernelcheck.run(CPU, torch.bfloat16, checks, tolerance=tolerance)
    assert all(c.passed and 0 < c.error < 3e-2 for c in bf16)  # bf16 rounding measured, within tolerance

    gla_gpu.chunk_gla = scaled_gradient(gla_gpu.chunk_gla)  # the fixture's monkeypatch restores it
    wrong = kernelcheck.run(CPU, torch.float32, checks, tolerance=tolerance)
    assert [c.kernel for c in kernelcheck.failures(wrong)] == ["chunk_gla", "chunk_gla_rows"]
    assert wrong[0].error == pytest.approx(0.5, rel=1e-3) and wrong[1].error == pytest.approx(0.5, rel=1e-3)


def test_a_wrong_gla_kernel_moves_the_run_to_the_reference_path_once_per_process(
    gla_gpu, monkeypatch, tmp_path, capsys
):
    """Through the CLI: a warning, the run trains on fla-naive-torch, the report and the kernel_check event
    say so and the dashboard header reads it; a later load in the same process is not checked again."""
    import fla.layers.gla as layer

    from trainer.families import gla
    from trainer.model.loading import load_for_training
    from trainer.runfolder.rundata import RunData
    from trainer.runfolder.summaries import kernels

    calls = []
    wrong = scaled_gradient(gla.naive_gla)
    monkeypatch.setattr(gla_gpu, "chunk_gla", lambda *a, **k: calls.append(1) or wrong(*a, **k))
    config = family_config(tmp_path, "tiny-gla", GLA_TARGETS, {"training": {"max_steps": 2}})
    assert cli("train", "--config", str(config)) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING: the gla")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING: the gla kernels of fla-triton FAILED their start-up self-check (chunk_gla off by 0.5"
    )
    assert warnings[0].endswith("this run trains on fla-naive-torch instead")
    run = tmp_path / "run"
    (report,) = events(run, "model_report")
    (check,) = events(run, "kernel_check")
    assert report["kernel_path"] == "fla-naive-torch" and layer.chunk_gla is gla.naive_gla
    assert check["passed"] is False and report["fast_path"]["self_check"] == check["results"]
    assert [r["kernel"] for r in check["results"] if not r["passed"]] == ["chunk_gla", "chunk_gla_rows"]
    header = RunData("run", run, tmp_path)
    header.refresh()
    assert (
        kernels(header)["summary"]
        == "kernels: fla-naive-torch, after a failed kernel self-check (chunk_gla, chunk_gla_rows)"
    )

    again = load_for_training(load_config(config), CPU).report  # e.g. `evaluate` after training
    assert again["kernel_path"] == "fla-naive-torch" and again["fast_path"]["self_check"] == check["results"]
    assert calls == [1, 1]  # measured once (both chunk_gla forms): the second load took the cached result


def test_right_gla_kernels_keep_the_triton_path(gla_gpu, tmp_path):
    from trainer.model.loading import load_for_training

    cfg = load_config(family_config(tmp_path, "tiny-gla", GLA_TARGETS))
    report = load_for_training(cfg, CPU).report
    assert report["kernel_path"] == "fla-triton"
    checked = report["fast_path"]["self_check"]
    assert [c["kernel"] for c in checked] == [
        "chunk_gla",
        "chunk_gla_rows",
        "fused_recurrent_gla",
        "rms_norm",
        "fused_rms_norm_gated",
    ]
    assert all(c["passed"] for c in checked)  # LoRA: fuse_swiglu is off, so no swiglu_linear to check


def test_a_forced_kernel_path_that_fails_its_check_stops_before_loading_with_exit_2(
    gla_gpu, monkeypatch, tmp_path, capsys
):
    from trainer.model import loading

    monkeypatch.setattr(loading, "load_base_model", lambda *a, **k: pytest.fail("weights loaded first"))
    monkeypatch.setattr(gla_gpu, "chunk_gla", scaled_gradient(gla_gpu.chunk_gla))
    config = family_config(tmp_path, "tiny-gla", GLA_TARGETS, {"model": {"kernel_path": "fla-triton"}})
    assert cli("train", "--config", str(config)) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(
        "error: model.kernel_path: fla-triton was forced, but its kernel self-check failed on this device: "
        "chunk_gla off by 0.5"
    )
    assert line.endswith("set model.kernel_path: auto to train on the next path that passes")


@pytest.mark.parametrize(
    ("model", "forced", "message"),
    [
        ("tiny-llama", "fla-triton",
         "model.kernel_path: 'fla-triton' is not a kernel path of causal models (llama); "
         "expected one of: auto, transformers"),
        ("tiny-mamba2", "mambapy",
         "model.kernel_path: 'mambapy' is not a kernel path of mamba models (mamba2); "
         "expected one of: auto, mamba_ssm, fla-triton-ssd, torch-reference"),
        ("tiny-mamba", "mamba_ssm",
         "model.kernel_path: mamba_ssm cannot run here: needs a CUDA GPU with mamba_ssm"),
    ],
)  # fmt: skip
def test_a_kernel_path_the_model_does_not_have_is_refused_before_loading(
    monkeypatch, tmp_path, model, forced, message
):
    from trainer.families import ModelLoadError
    from trainer.model import loading

    monkeypatch.setattr(loading, "load_base_model", lambda *a, **k: pytest.fail("weights loaded first"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(family_config(tmp_path, model, None, {"model": {"kernel_path": forced}}))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loading.load_for_training(cfg, CPU)


def test_the_config_accepts_exactly_the_families_path_names():
    """model.kernel_path is checked with the config, before any family is imported: its list must be the
    families' own names."""
    import typing

    from transformers import Mamba2Config, MambaConfig

    from trainer.config.sections import ModelConfig
    from trainer.families import CAUSAL, gla, mamba

    accepted = set(typing.get_args(ModelConfig.__pydantic_fields__["kernel_path"].annotation)) - {"auto"}
    families = set(CAUSAL.kernel_paths(None)) | set(gla.kernel_paths(None))
    families |= set(mamba.kernel_paths(MambaConfig())) | set(mamba.kernel_paths(Mamba2Config()))
    assert accepted == families


# ---------------------------------------------------------------- Mamba


def mamba_config(model: str):
    from transformers import Mamba2Config, MambaConfig

    return (Mamba2Config if model == "tiny-mamba2" else MambaConfig).from_pretrained(REPO / "configs" / model)


@pytest.fixture
def mamba_gpu(monkeypatch, fresh_cache):
    """mamba_ssm looks installed on a GPU; transformers' bindings are whatever the test sets (on a CPU,
    its PyTorch functions, which are right)."""
    from trainer.families import mamba, mamba_checks

    monkeypatch.setattr(mamba, "_cuda_available", lambda: True)
    monkeypatch.setattr(mamba, "_importable", lambda name: name in ("mamba_ssm", "causal_conv1d"))
    monkeypatch.setattr(mamba, "_fla_usable", lambda: False)
    monkeypatch.setattr(mamba, "_installed", lambda name: name == "mambapy")
    monkeypatch.setattr(mamba, "_mambapy_trains", lambda: True)
    monkeypatch.setattr(mamba, "_REPLACED", {})
    monkeypatch.setattr(mamba_checks, "MAMBA1_TOKENS", 16)  # the sequential reference scan is slow on a CPU
    return mamba


# The function each generation's mamba_ssm path reaches on a CPU (the fused one returns None there).
SCAN = {"tiny-mamba2": "mamba2_chunk_scan", "tiny-mamba": "mamba_selective_scan"}


@pytest.mark.parametrize(
    ("model", "kernel", "fallback"),
    [
        ("tiny-mamba2", "mamba_split_conv1d_scan_combined", "torch-reference"),
        ("tiny-mamba", "mamba_inner_fn", "mambapy"),
    ],
)
def test_a_wrong_mamba_kernel_moves_the_run_to_the_next_correct_path(
    mamba_gpu, monkeypatch, capsys, model, kernel, fallback
):
    """mamba_ssm's kernel with a wrong gradient: Mamba-2 falls to the reference (fla is not here), Mamba-1 to
    mambapy, whose own check passes; forced, the same failure stops the run; the right kernel is kept."""
    from trainer.families.mamba import MAMBA

    hf_config = mamba_config(model)
    module, _ = mamba_gpu._modeling(hf_config.model_type)
    right = getattr(module, SCAN[model])
    choice = kernel_choice.choose(MAMBA, hf_config, "auto", CPU, torch.float32)
    assert choice.path == "mamba_ssm" and [c.kernel for c in choice.checks] == [kernel]
    assert choice.checks[0].passed and choice.checks[0].error < 1e-6

    monkeypatch.setattr(module, SCAN[model], scaled_gradient(inspect.unwrap(right)))
    monkeypatch.setattr(kernelcheck, "_CACHE", {})
    choice = kernel_choice.choose(MAMBA, hf_config, "auto", CPU, torch.float32)
    assert choice.path == fallback
    assert [(c.kernel, c.passed) for c in choice.checks][0] == (kernel, False)
    if fallback == "mambapy":
        assert [(c.kernel, c.passed) for c in choice.checks][1:] == [("mambapy_pscan", True)]
    assert f"WARNING: the mamba kernels of mamba_ssm FAILED their start-up self-check ({kernel} off by" in (
        capsys.readouterr().err
    )
    assert getattr(module, SCAN[model]) is not right  # the check put transformers' bindings back as they were
    with pytest.raises(
        kernel_choice.KernelPathUnavailable, match="model.kernel_path: mamba_ssm was forced, but"
    ):
        kernel_choice.choose(MAMBA, hf_config, "mamba_ssm", CPU, torch.float32)


def test_the_chosen_mamba_path_is_what_the_model_runs(mamba_gpu, monkeypatch, tmp_path):
    """Moved off mamba_ssm, the loaded model reaches transformers' PyTorch functions, not the kernel."""
    from trainer.model.loading import load_for_training

    module, _ = mamba_gpu._modeling("mamba2")
    right = module.mamba2_chunk_scan
    monkeypatch.setattr(module, "mamba2_chunk_scan", scaled_gradient(inspect.unwrap(right)))
    for name in mamba_gpu._mixer_calls("mamba2"):  # use_kernel_path rebinds them for the process
        if hasattr(module, name):
            monkeypatch.setattr(module, name, getattr(module, name))
    cfg = load_config(family_config(tmp_path, "tiny-mamba2", ["in_proj"]))
    loaded = load_for_training(cfg, CPU)
    assert loaded.report["kernel_path"] == "torch-reference"
    assert module.mamba2_chunk_scan is inspect.unwrap(right)
    assert loaded.report["fast_path"]["self_check"][0]["passed"] is False


def test_self_check_results_are_measured_once_per_process_key_and_dtype(fresh_cache):
    calls = []

    def check(device, dtype):
        calls.append(dtype)
        return 0.0

    for _ in range(3):
        assert kernelcheck.run(CPU, torch.float32, {"op": check}, key=("gla", "fla-triton", "{}"))[0].passed
    kernelcheck.run(CPU, torch.bfloat16, {"op": check}, key=("gla", "fla-triton", "{}"))
    kernelcheck.run(CPU, torch.float32, {"op": check}, key=("gla", "fla-triton", "{other config}"))
    kernelcheck.run(CPU, torch.float32, {"op": check})  # no key: measured every time
    assert calls == [torch.float32, torch.bfloat16, torch.float32, torch.float32]


def test_mamba_check_runs_16bit_weights_without_autocast_too(mamba_gpu, monkeypatch):
    """A bf16 check runs the mixer as every bf16 run may: bf16 weights without autocast as well as under it.
    mambapy's scan without its fp32 read-out passed the check under autocast alone and then crashed at step
    one of a run with bf16 weights and no mixed precision; now the check fails it, and the fixed scan passes."""
    from trainer.families.mamba import MAMBA

    hf_config = mamba_config("tiny-mamba")
    module, _ = mamba_gpu._modeling("mamba")
    monkeypatch.setattr(module, "mamba_selective_scan", module.mamba_selective_scan)  # rebound below
    choice = kernel_choice.choose(MAMBA, hf_config, "mambapy", CPU, torch.bfloat16)
    assert [(c.kernel, c.passed) for c in choice.checks] == [("mambapy_pscan", True)]

    monkeypatch.setattr(mamba_gpu, "_readout_in_fp32", lambda scan: scan)  # the scan as transformers has it
    monkeypatch.setattr(kernelcheck, "_CACHE", {})
    with pytest.raises(kernel_choice.KernelPathUnavailable, match="mambapy_pscan RuntimeError: expected"):
        kernel_choice.choose(MAMBA, hf_config, "mambapy", CPU, torch.bfloat16)
