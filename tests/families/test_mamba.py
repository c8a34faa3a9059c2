"""Mamba-1 and Mamba-2 (transformers) on a CPU: training through the CLI, exact resume, packing off
with padded rows that do not leak, LoRA variants, QLoRA with dt_proj kept unquantized, kernel-path
selection, and the Mamba-2 SSD-as-simple-GLA mapping behind the fla Triton fast path."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.families.helpers import (
    VARIANTS,
    assert_resumed_exactly,
    check_example_yaml_runs,
    check_qlora_gradients,
    check_variant_trains,
    cli,
    error_line,
    events,
    family_config,
    train_in_process,
    train_killed_and_resumed,
)
from tests.helpers import REPO
from trainer.config import load_config
from trainer.data.dataset import Sequence, collate
from trainer.families import mamba as mamba_family

MODELS = {
    "tiny-mamba2": {"model_type": "mamba2", "kernel": "torch-reference", "targets": ["in_proj", "lm_head"]},
    "tiny-mamba": {
        "model_type": "mamba",
        "kernel": "mambapy" if mamba_family._mambapy_trains() else "torch-reference",
        "targets": ["in_proj", "x_proj", "lm_head"],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("model, init", [("tiny-mamba2", "pissa"), ("tiny-mamba", "default")])
def test_mamba_trains_through_the_cli_and_resumes_exactly(tmp_path, capsys, model, init):
    """Mamba-2 with PiSSA (its residual base weights are rebuilt identically on resume), Mamba-1 on mambapy."""
    spec = MODELS[model]
    extra = {"lora": {"init": init}}
    # Reference and resume run the CLI in this process; the run that is killed is a real subprocess.
    reference = train_in_process(family_config(tmp_path, model, spec["targets"], extra, output="reference"))
    assert reference[8] < reference[1] - 0.05  # it learns
    report = events(tmp_path / "reference", "model_report")[0]
    assert report["kernel_path"] == spec["kernel"]
    assert events(tmp_path / "reference", "data_report")[0]["packing"] is False

    run = tmp_path / "run"
    stdout = train_killed_and_resumed(family_config(tmp_path, model, spec["targets"], extra), run, capsys)
    assert f"kernels: mamba/{spec['model_type']} runs on {spec['kernel']}" in stdout
    assert_resumed_exactly(run, reference)
    info = json.loads((run / "run.json").read_text())
    assert info["family"] == "mamba" and info["model_type"] == spec["model_type"]


@pytest.fixture(scope="module", params=list(MODELS))
def mamba_model(request, tmp_path_factory):
    from trainer.model.loading import load_for_training

    folder = tmp_path_factory.mktemp(request.param)
    cfg = load_config(family_config(folder, request.param, ["in_proj"], {"training": {"method": "full"}}))
    loaded = load_for_training(cfg, torch.device("cpu"))
    return loaded.model.eval(), loaded.tokenizer, cfg


def test_mamba_rows_hold_one_document_and_padding_does_not_leak(mamba_model):
    from trainer.data.dataset import prepare_data
    from trainer.families import family_for, family_inputs

    model, tokenizer, cfg = mamba_model
    family = family_for(model.config.model_type)
    assert family.packing is False
    data = prepare_data(cfg.paths, cfg.data, tokenizer, family.packing)
    assert data.report.packing is False
    bos = tokenizer.bos_token_id
    for i in range(min(50, len(data.train))):  # one document or one chunk of one: never a second start
        row = data.train[i]
        assert row.position_ids.tolist() == list(range(len(row.input_ids)))
        assert bos not in row.input_ids[1:]

    gen = torch.Generator().manual_seed(0)
    doc_a, other_a = (torch.randint(4, 1000, (40,), generator=gen).tolist() for _ in range(2))
    doc_b = torch.randint(4, 1000, (23,), generator=gen).tolist()

    def logits_of_b(a):
        batch = collate([Sequence(a, a, list(range(40))), Sequence(doc_b, doc_b, list(range(23)))], 0)
        inputs = family_inputs(model, batch)
        assert set(inputs) == {"input_ids", "attention_mask"}  # no position_ids: Mamba ignores them
        with torch.no_grad():
            return model(**inputs).logits[1, :23]

    with torch.no_grad():
        alone = model(input_ids=torch.tensor([doc_b])).logits[0]
        packed = model(input_ids=torch.tensor([doc_a + doc_b])).logits[0, 40:]
    torch.testing.assert_close(logits_of_b(doc_a), alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits_of_b(other_a), alone, rtol=0, atol=1e-5)
    # Why packing is off: concatenated, B's logits depend on A.
    assert (packed - alone).abs().max() > 1e-3


def naive_simple_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
    """fla's pure-PyTorch simple-GLA reference behind chunk_simple_gla's arguments (CPU stand-in)."""
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    assert cu_seqlens is None
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, state = naive_recurrent_simple_gla(
        q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )
    if state is not None and state_v_first:
        state = state.transpose(-1, -2)
    return o, state


@pytest.mark.parametrize("with_state, dt_limit", [(False, (0.0, float("inf"))), (True, (0.01, 0.5))])
def test_mamba2_ssd_as_simple_gla_matches_transformers_reference(with_state, dt_limit):
    """The maths of the fla-triton-ssd fast path, checked with fla's reference op in place of its kernel."""
    pytest.importorskip("fla.ops.simple_gla.naive")
    from transformers.models.mamba2 import modeling_mamba2

    from trainer.families.mamba import fla_ssd_scan

    gen = torch.Generator().manual_seed(0)
    b, t, h, p, g, n = 2, 40, 4, 8, 2, 16
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    A, D, dt_bias = (
        -torch.rand(h, generator=gen) * 2,
        torch.randn(h, generator=gen),
        torch.randn(h, generator=gen),
    )
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    state = torch.randn(b, h, p, n, generator=gen) if with_state else None
    args = dict(D=D, dt_bias=dt_bias, initial_states=state, dt_softplus=True, dt_limit=dt_limit)
    expected, expected_state = modeling_mamba2.mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=16, return_final_states=True, **args
    )
    out, out_state = fla_ssd_scan(
        x, dt, A, B, C, chunk_size=16, return_final_states=True, op=naive_simple_gla, **args
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out_state, expected_state, rtol=1e-5, atol=1e-4)
    assert fla_ssd_scan(x, dt, A, B, C, chunk_size=16, op=naive_simple_gla, **args).shape == x.shape


def test_mamba2_ssd_scan_runs_in_fp32_from_16_bit_inputs():
    """fla's gate gradient from 16-bit q, k, v was 2-14x off on an H200 (dt_bias, A_log): the scan gets fp32."""
    from trainer.families.mamba import fla_ssd_scan

    seen = []

    def op(q, k, v, g, **_):
        seen.append((q.dtype, k.dtype, v.dtype, g.dtype))
        return torch.zeros_like(v), None

    x, dt = torch.randn(1, 8, 2, 4).bfloat16(), torch.rand(1, 8, 2).bfloat16()
    B, C = torch.randn(1, 8, 1, 4).bfloat16(), torch.randn(1, 8, 1, 4).bfloat16()
    fla_ssd_scan(x, dt, -torch.rand(2), B, C, op=op)
    assert seen == [(torch.float32,) * 4]


@pytest.mark.slow
@pytest.mark.parametrize("variant, init", VARIANTS)
@pytest.mark.parametrize("model", list(MODELS))
def test_mamba_lora_variants_train(tmp_path, model, variant, init):
    loaded = check_variant_trains(tmp_path, model, MODELS[model]["targets"], variant, init)
    adapted = {n.split(".")[-4] for n, p in loaded.model.named_parameters() if "lora_A" in n}
    assert adapted == set(MODELS[model]["targets"])


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_mamba_dora_on_4bit_layers_trains(tmp_path, model):
    check_variant_trains(tmp_path, model, MODELS[model]["targets"][:-1], "dora", "default", method="qlora")


@pytest.mark.parametrize("model", list(MODELS))
def test_mamba_qlora_keeps_directly_read_weights_unquantized_and_gradients_right(tmp_path, model):
    import bitsandbytes as bnb

    from trainer.model.loading import load_for_training

    targets = MODELS[model]["targets"][:-1]
    extra = {"training": {"method": "qlora"}, "lora": {"dropout": 0.0}}
    peft_model = load_for_training(
        load_config(family_config(tmp_path, model, targets, extra)), torch.device("cpu")
    ).model
    kinds = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            short = name.removesuffix(".base_layer").split(".")[-1]
            kinds.setdefault(short, set()).add(isinstance(module, bnb.nn.Linear4bit))
    if model == "tiny-mamba":
        # the reference scan computes dt_proj.weight @ x itself: a 4-bit dt_proj would break it
        assert kinds == {
            "in_proj": {True},
            "x_proj": {True},
            "dt_proj": {False},
            "out_proj": {True},
            "lm_head": {False},
        }
    else:
        assert kinds == {"in_proj": {True}, "out_proj": {True}, "lm_head": {False}}
    rows = [Sequence(list(range(4, 40)), list(range(4, 40)), list(range(36))) for _ in range(2)]
    check_qlora_gradients(peft_model, collate(rows, 0), expected_tensors=2 * 2 * len(targets))


@pytest.mark.slow
def test_mamba_out_proj_target_is_exit_2_before_loading(tmp_path, capsys, monkeypatch):
    from trainer.model import loading

    monkeypatch.setattr(loading, "load_base_model", lambda *a, **k: pytest.fail("weights loaded first"))
    config = family_config(tmp_path, "tiny-mamba2", ["in_proj", "out_proj"])
    assert cli("train", "--config", str(config)) == 2
    assert error_line(capsys.readouterr().err).startswith(
        "error: lora.target_modules: out_proj cannot take LoRA in Mamba models"
    )


@pytest.mark.parametrize(
    "model, extra, message",
    [
        (
            "tiny-mamba2",
            {"lora": {"target_modules": ["conv1d"]}},
            "lora.target_modules: conv1d cannot take LoRA",
        ),
        ("tiny-mamba", {"lora": {"target_modules": ["in_proj", "dt_proj"]}}, "dt_proj would get no gradient"),
        ("tiny-mamba2", {"lora": {"target_modules": "all-linear"}}, "all-linear would include out_proj"),
        (
            "tiny-mamba",
            {"training": {"method": "qlora"}, "lora": {"init": "pissa_niter_4"}},
            "lora.init: pissa_niter_4",
        ),
    ],
)
def test_mamba_lora_settings_it_cannot_train_are_refused_before_loading(
    tmp_path, monkeypatch, model, extra, message
):
    from trainer.families import ModelLoadError
    from trainer.model import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the LoRA settings were checked")

    monkeypatch.setattr(loading, "load_base_model", no_loading)
    cfg = load_config(family_config(tmp_path, model, MODELS[model]["targets"], extra))
    with pytest.raises(ModelLoadError, match=message):
        loading.load_for_training(cfg, torch.device("cpu"))


def test_kernel_path_follows_what_is_installed(monkeypatch, capsys):
    from transformers import Mamba2Config, MambaConfig

    from trainer.families import ModelLoadError, mamba

    mamba1, mamba2 = MambaConfig(), Mamba2Config()
    installed = {"mambapy"}
    monkeypatch.setattr(mamba, "_installed", lambda name: name in installed)
    monkeypatch.setattr(mamba, "_importable", lambda name: name in installed)
    monkeypatch.setattr(mamba, "_fla_usable", lambda: True)
    monkeypatch.setattr(
        mamba, "_mambapy_trains", lambda: True
    )  # a transformers whose mixer trains via mambapy
    assert (mamba.kernel_path(mamba1), mamba.kernel_path(mamba2)) == ("mambapy", "torch-reference")
    assert mamba.default_lora_targets(mamba1) == ["in_proj", "x_proj"]
    assert mamba.default_lora_targets(mamba2) == ["in_proj"]
    assert (
        mamba.quantization_skip(mamba1, None) == ("dt_proj",) and mamba.quantization_skip(mamba2, None) == ()
    )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (mamba.kernel_path(mamba1), mamba.kernel_path(mamba2)) == ("mambapy", "fla-triton-ssd")
    mamba.configure(mamba1, None)
    assert "WARNING: mamba is training on a GPU WITHOUT fast kernels (mambapy)" in capsys.readouterr().err
    mamba.configure(mamba2, None)
    assert capsys.readouterr().err == ""  # fla's Triton path is a fast one

    installed |= {"mamba_ssm", "causal_conv1d"}
    assert (mamba.kernel_path(mamba1), mamba.kernel_path(mamba2)) == ("mamba_ssm", "mamba_ssm")
    assert mamba.quantization_skip(mamba1, None) == ("dt_proj", "x_proj", "out_proj")
    assert mamba.quantization_skip(mamba2, None) == ("out_proj",)
    # mamba_inner_fn reads x_proj's weight directly, so the default targets drop it there
    assert mamba.default_lora_targets(mamba1) == mamba.default_lora_targets(mamba2) == ["in_proj"]
    with pytest.raises(ModelLoadError, match="x_proj would get no gradient"):
        mamba.check_lora(None, mamba1, ["in_proj", "x_proj"])
    mamba.check_lora(None, mamba2, ["in_proj", "x_proj"])

    installed.clear()
    monkeypatch.setattr(mamba, "_fla_usable", lambda: False)
    assert mamba.kernel_path(mamba2) == "torch-reference"
    mamba.configure(mamba2, None)
    assert (
        "WARNING: mamba2 is training on a GPU WITHOUT fast kernels (torch-reference)"
        in capsys.readouterr().err
    )


def test_fla_kernels_replace_only_the_scan_and_conv(monkeypatch):
    from transformers.models.mamba2 import modeling_mamba2

    from trainer.families import mamba

    assert mamba._fla_usable()  # this transformers' Mamba-2 mixer calls the two functions swapped below
    for name in ("mamba2_chunk_scan", "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined"):
        monkeypatch.setattr(modeling_mamba2, name, getattr(modeling_mamba2, name))  # restored afterwards
    fused = modeling_mamba2.mamba2_split_conv1d_scan_combined
    mamba.use_fla_kernels()
    assert modeling_mamba2.mamba2_chunk_scan is mamba.fla_ssd_scan
    assert modeling_mamba2.causal_conv1d_fn is mamba.fla_causal_conv1d
    assert modeling_mamba2.mamba2_split_conv1d_scan_combined is fused


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-mamba"])
def test_example_yaml_runs(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    check_example_yaml_runs(tmp_path, name)


def test_mambapy_label_follows_what_the_mixer_really_trains_through(monkeypatch):
    """The label says mambapy exactly when a training forward of transformers' own Mamba-1 mixer (no
    mamba_ssm here) calls mambapy's parallel scan."""
    pscan_module = pytest.importorskip("mambapy.pscan")
    from transformers import MambaConfig
    from transformers.models.mamba import modeling_mamba

    calls = []
    real = pscan_module.pscan
    monkeypatch.setattr(pscan_module, "pscan", lambda *a: calls.append(1) or real(*a))
    config = MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=32, use_mambapy=True)
    mixer = modeling_mamba.MambaMixer(config, layer_idx=0).train()
    mixer(torch.randn(1, 8, 16, requires_grad=True)).sum().backward()
    assert mamba_family._mambapy_trains() is bool(calls)
    if not torch.cuda.is_available():
        assert mamba_family.kernel_path(MambaConfig()) == ("mambapy" if calls else "torch-reference")


def test_importable_is_stricter_than_installed(tmp_path, monkeypatch):
    """A package whose import fails (a mamba_ssm left without its compiled library) is no kernel path."""
    (tmp_path / "broken_kernels").mkdir()
    (tmp_path / "broken_kernels" / "__init__.py").write_text("import selective_scan_cuda_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert mamba_family._installed("broken_kernels") and not mamba_family._importable("broken_kernels")
    assert mamba_family._importable("json")


@pytest.mark.parametrize("model_type", ["mamba2", "mamba"])
def test_reference_kernels_restore_transformers_pytorch_code(monkeypatch, model_type):
    """With mamba_ssm installed, transformers binds its kernels at import; the benchmark's baseline and its
    correctness check need the PyTorch code back for a while, on the same card, then the fast kernels again."""
    import functools

    module, mixer = mamba_family._modeling(model_type)
    name = "mamba2_chunk_scan" if model_type == "mamba2" else "mamba_inner_fn"
    pytorch_version = inspect.unwrap(getattr(module, name))

    @functools.wraps(pytorch_version)
    def fast_kernel(*args, **kwargs):  # what transformers' wrapper looks like around an installed kernel
        raise AssertionError("the fast kernel ran inside reference_kernels")

    monkeypatch.setattr(module, name, fast_kernel)
    with mamba_family.reference_kernels(model_type) as swapped:
        assert getattr(module, name) is pytorch_version and name in swapped
        assert "causal_conv1d_fn" in swapped
    assert getattr(module, name) is fast_kernel
    if model_type == "mamba2":  # and it undoes the fla swap too
        for original in ("mamba2_chunk_scan", "causal_conv1d_fn"):
            monkeypatch.setattr(module, original, getattr(module, original))
        monkeypatch.setattr(mamba_family, "_REPLACED", {})
        mamba_family.use_fla_kernels()
        with mamba_family.reference_kernels(model_type):
            assert module.mamba2_chunk_scan is pytorch_version
        assert module.mamba2_chunk_scan is mamba_family.fla_ssd_scan


@pytest.mark.parametrize(
    ("model", "expected"), [("tiny-mamba", {"in_proj", "x_proj"}), ("tiny-mamba2", {"in_proj"})]
)
def test_unset_targets_take_the_family_defaults_for_this_kernel_path(tmp_path, model, expected):
    """lora.target_modules unset: the loaded model gets LoRA where the family's defaults say (off the
    mamba_ssm path Mamba-1 also takes x_proj), and nowhere else."""
    from trainer.model.loading import load_for_training

    cfg = load_config(family_config(tmp_path, model, None))
    peft_model = load_for_training(cfg, torch.device("cpu")).model
    wrapped = {
        name.split(".lora_A.")[0].split(".")[-1]
        for name, _ in peft_model.named_parameters()
        if ".lora_A." in name
    }
    assert wrapped == expected


@pytest.mark.parametrize("path, scans", [("mambapy", True), ("torch-reference", False)])
def test_mamba1_kernel_path_decides_whether_mambapy_trains(tmp_path, monkeypatch, path, scans):
    """`mambapy` trains through mambapy's parallel scan; `torch-reference` is transformers' sequential scan,
    the baseline the fast paths are measured against, even where mambapy is installed."""
    pscan_module = pytest.importorskip("mambapy.pscan")
    if not mamba_family._mambapy_trains():
        pytest.skip("this transformers' Mamba-1 mixer never trains through mambapy")
    from trainer.model.loading import load_for_training

    calls = []
    real = pscan_module.pscan
    monkeypatch.setattr(pscan_module, "pscan", lambda *a: calls.append(1) or real(*a))
    cfg = load_config(family_config(tmp_path, "tiny-mamba", ["in_proj"], {"model": {"kernel_path": path}}))
    loaded = load_for_training(cfg, torch.device("cpu"))
    assert loaded.report["kernel_path"] == path
    ids = torch.randint(3, 100, (1, 16))
    loaded.model.train()
    loaded.model(input_ids=ids, labels=ids).loss.backward()
    assert bool(calls) is scans


class _Accelerator:
    """What forward_loss needs from accelerate: the device and the loop's autocast (on under mixed precision)."""

    device = torch.device("cpu")

    def __init__(self, mixed_precision: str):
        self.mixed_precision = mixed_precision

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mixed_precision == "bf16")


# (method, model.dtype, training.mixed_precision, kernel path): every way a GPU run of tiny-mamba may take
# bf16. The first is configs/tiny-mamba.yaml on a GPU (model.dtype auto is bf16 there, mixed precision off),
# which crashed at step one on mambapy: `all_states @ C` with fp32 states and bf16 C, no autocast to cast them.
MAMBA1_REGIMES = [
    ("lora", "bf16", "no", "mambapy"),
    ("lora", "bf16", "bf16", "mambapy"),
    ("lora", "fp32", "bf16", "mambapy"),
    ("lora", "bf16", "no", "torch-reference"),
    ("qlora", "bf16", "no", "mambapy"),
    ("qlora", "bf16", "bf16", "mambapy"),
]


@pytest.mark.parametrize("method, dtype, mixed_precision, path", MAMBA1_REGIMES)
def test_mamba1_trains_in_bf16_without_autocast_as_a_gpu_run_does(
    tmp_path, monkeypatch, method, dtype, mixed_precision, path
):
    """The GPU's code path and dtypes on a CPU: bf16 weights (and, for QLoRA, the 16-bit parameters a GPU run
    keeps, ``keeps_16bit_under_qlora``), x_proj's C in bf16 into mambapy's fp32 states, with or without the
    loop's autocast. A few steps train, and the mixer really got bf16 C from x_proj where the weights are bf16."""
    from trainer.model import loading
    from trainer.training.step import count_targets, forward_loss

    if path == "mambapy" and not mamba_family._mambapy_trains():
        pytest.skip("this transformers' Mamba-1 mixer never trains through mambapy")
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
        monkeypatch.setattr(loading, "keeps_16bit_under_qlora", lambda *args: True)  # as on a GPU
    extra = {
        "model": {"dtype": dtype, "kernel_path": path},
        "training": {"method": method, "mixed_precision": mixed_precision},
        "quantization": {"compute_dtype": "bf16"},
        "lora": {"dropout": 0.0},
    }
    cfg = load_config(family_config(tmp_path, "tiny-mamba", ["in_proj", "x_proj"], extra))
    loaded = loading.load_for_training(cfg, torch.device("cpu"))
    assert loaded.report["kernel_path"] == path
    model = loaded.model.train()
    seen_c = []
    for name, module in model.named_modules():
        if name.endswith("mixer.x_proj"):
            module.register_forward_hook(lambda mod, args, out: seen_c.append(out.dtype))
    rows = [Sequence(list(range(4, 36)), list(range(4, 36)), list(range(32))) for _ in range(2)]
    batch = collate(rows, 0)
    accelerator = _Accelerator(mixed_precision)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses_seen = []
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        ce_sum, _ = forward_loss(model, batch, accelerator)
        (ce_sum / count_targets(batch)).backward()
        optimizer.step()
        losses_seen.append(float(ce_sum.detach()) / count_targets(batch))
    assert all(torch.isfinite(torch.tensor(losses_seen))) and losses_seen[-1] < losses_seen[0], losses_seen
    assert set(seen_c) == {torch.bfloat16}


def test_mamba2_offers_fla_on_hopper_with_the_kits_gated_backward(monkeypatch):
    """On Hopper with triton 3.4-3.7.0 fla raises in the SSD scan's backward (fla #640). The path is still
    offered there: binding it registers the kit's corrected kernel with fla, and the self-check judges."""
    from transformers import Mamba2Config

    from trainer.families import fla_gated_dqk, mamba

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mamba, "_importable", lambda name: False)
    monkeypatch.setattr(mamba, "_fla_usable", lambda: True)
    monkeypatch.setattr(fla_gated_dqk, "affected", lambda: True)
    assert mamba.kernel_paths(Mamba2Config())["fla-triton-ssd"] is None
    assert mamba.kernel_path(Mamba2Config()) == "fla-triton-ssd"
    registered = []
    monkeypatch.setattr(fla_gated_dqk, "register", lambda: registered.append(True) or True)
    module, _ = mamba._modeling("mamba2")
    for name in {*mamba._mixer_calls("mamba2"), *mamba.FLA_SWAPPED}:  # put back after the test
        monkeypatch.setattr(module, name, getattr(module, name, None), raising=False)
    mamba.use_kernel_path("mamba2", "fla-triton-ssd")
    assert registered == [True]
    assert module.mamba2_chunk_scan is mamba.fla_ssd_scan
