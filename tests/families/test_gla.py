"""GLA (flash-linear-attention) on a CPU: fla's model really runs, on its pure-PyTorch reference op;
training through the CLI, exact resume, packed documents kept apart by cu_seqlens, LoRA variants, QLoRA."""

from __future__ import annotations

import json

import pytest
import torch

from tests.families.helpers import (
    VARIANTS,
    adapter_tensors,
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
from trainer.data.dataset import collate, pack

pytest.importorskip(
    "fla.models", reason="the gla family needs flash-linear-attention (pip install -e .[gla])"
)

TARGETS = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "lm_head"]


@pytest.mark.slow
def test_gla_trains_through_the_cli_and_resumes_exactly(tmp_path, capsys):
    """DoRA adapters (their magnitude vectors too) come back exactly after a SIGKILL."""
    dora = {"lora": {"variant": "dora"}}
    # Reference and resume run the CLI in this process; the run that is killed is a real subprocess.
    reference = train_in_process(family_config(tmp_path, "tiny-gla", TARGETS, dora, output="reference"))
    assert reference[8] < reference[1] - 0.05  # it learns
    report = events(tmp_path / "reference", "model_report")[0]
    assert report["kernel_path"] == "fla-naive-torch"
    assert events(tmp_path / "reference", "data_report")[0]["packing"] is True

    run = tmp_path / "run"
    stdout = train_killed_and_resumed(family_config(tmp_path, "tiny-gla", TARGETS, dora), run, capsys)
    assert "kernels: gla/gla runs on fla-naive-torch" in stdout
    assert_resumed_exactly(run, reference)
    info = json.loads((run / "run.json").read_text())
    assert info["family"] == "gla" and info["model_type"] == "gla"
    assert any("lora_magnitude_vector" in k for k in adapter_tensors(run, 8))


@pytest.fixture(scope="module")
def gla_model(tmp_path_factory):
    """The tiny GLA, random weights, as load_for_training builds it on this (CUDA-less) machine."""
    from trainer.model.loading import load_for_training

    folder = tmp_path_factory.mktemp("gla")
    cfg = load_config(family_config(folder, "tiny-gla", TARGETS, {"training": {"method": "full"}}))
    loaded = load_for_training(cfg, torch.device("cpu"))
    return loaded.model.eval(), loaded.tokenizer


def packed_logits(model, docs: list[list[int]], width: int, pad_id: int):
    from trainer.families import family_inputs

    rows = pack([(d, d) for d in docs], width, pad_id)
    assert len(rows) == 1
    batch = collate(rows, pad_id)
    inputs = family_inputs(model, batch)
    assert inputs["input_ids"].shape == (1, width) and inputs["cu_seqlens"].tolist()[:3] == [
        0,
        len(docs[0]),
        len(docs[0]) + len(docs[1]),
    ]
    with torch.no_grad():
        return model(**inputs).logits[0], batch


def test_gla_packed_documents_do_not_see_each_other(gla_model):
    model, tokenizer = gla_model
    pad = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(0)
    doc_a = torch.randint(4, 1000, (19,), generator=gen).tolist()
    other_a = torch.randint(4, 1000, (19,), generator=gen).tolist()
    doc_b = torch.randint(4, 1000, (29,), generator=gen).tolist()

    logits, _ = packed_logits(model, [doc_a, doc_b], 48, pad)
    changed, _ = packed_logits(model, [other_a, doc_b], 48, pad)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([doc_b])).logits[0]
        leaky = model(input_ids=torch.tensor([doc_a + doc_b])).logits[0]
    span = slice(19, 48)
    assert not torch.allclose(logits[:19], changed[:19])  # A really changed
    torch.testing.assert_close(logits[span], changed[span], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits[span], alone, rtol=0, atol=1e-5)
    # The same row without boundaries leaks A into B: the check above can fail.
    assert (leaky[span] - alone).abs().max() > 1e-3

    # Without packing, rows are padded and masked: B in a batch with a longer A gives B's logits too.
    from trainer.data.dataset import Sequence
    from trainer.families import family_inputs

    rows = [Sequence(d, d, list(range(len(d)))) for d in (doc_a + other_a, doc_b)]
    batch = collate(rows, pad)
    inputs = family_inputs(model, batch)
    assert set(inputs) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        padded = model(**inputs).logits[1, :29]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


def test_rows_of_one_document_each_stay_rows_and_give_the_varlen_logits(gla_model):
    """Rows that each hold one document go to fla as rows (its fixed-length path, which CUDA graphs can
    record), not flattened through cu_seqlens; the logits are those of the varlen form. Packed rows and
    padded rows are the calls GLA's layers keep eager (``gla.eager_call``)."""
    from trainer.data.dataset import Sequence
    from trainer.families import family_inputs, gla

    model, _ = gla_model
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(4, 1000, (40,), generator=gen).tolist() for _ in range(3)]
    batch = collate([Sequence(d, d, list(range(40))) for d in docs], 0)
    inputs = family_inputs(model, batch)
    assert set(inputs) == {"input_ids"} and inputs["input_ids"].shape == (3, 40)
    varlen = {"input_ids": batch["input_ids"].reshape(1, -1), "cu_seqlens": torch.tensor([0, 40, 80, 120])}
    with torch.no_grad():
        rows = model(**inputs).logits
        flat = model(**varlen).logits.reshape(3, 40, -1)
    torch.testing.assert_close(rows, flat, rtol=0, atol=1e-5)
    assert not gla.eager_call({"attention_mask": None}) and not gla.eager_call({})
    assert gla.eager_call(varlen) and gla.eager_call({"attention_mask": torch.ones(2, 3)})
    two_docs = collate([Sequence(docs[0], docs[0], list(range(20)) + list(range(20)))], 0)
    assert "cu_seqlens" in family_inputs(model, two_docs)
    # a short row's padding unmasked (what a graphed stack's step passes): rows still, so the batch replays
    from trainer.families.base import unmask_right_padding

    short = collate([Sequence(d, d, list(range(len(d)))) for d in (docs[0], docs[1][:25])], 0)
    assert gla.eager_call(family_inputs(model, short))
    unmasked = family_inputs(model, unmask_right_padding(short))
    assert set(unmasked) == {"input_ids"} and not gla.eager_call(unmasked)
    with torch.no_grad():
        masked_logits = model(**family_inputs(model, short)).logits.reshape(2, 40, -1)
        logits = model(**unmasked).logits
    torch.testing.assert_close(
        logits[short["token_mask"]], masked_logits[short["token_mask"]], rtol=0, atol=1e-5
    )


def test_reference_op_keeps_varlen_sequences_and_states_apart():
    from fla.ops.gla.naive import naive_recurrent_gla

    from trainer.families.gla import naive_gla

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 11, 3]
    q, k, v = (torch.randn(1, sum(lengths), 2, d, generator=gen) for d in (8, 8, 6))
    gk = torch.nn.functional.logsigmoid(torch.randn(1, sum(lengths), 2, 8, generator=gen))
    h0 = torch.randn(3, 2, 6, 8, generator=gen)  # state_v_first: [N, H, V, K]
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    o, ht = naive_gla(
        q, k, v, gk, initial_state=h0, output_final_state=True, state_v_first=True, cu_seqlens=cu
    )
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, h_i = naive_recurrent_gla(
            q[:, a:b], k[:, a:b], v[:, a:b], gk[:, a:b], h0[i : i + 1].transpose(-1, -2), True
        )
        torch.testing.assert_close(o[:, a:b], o_i)
        torch.testing.assert_close(ht[i : i + 1], h_i.transpose(-1, -2))


def test_torch_norms_match_fla_reference_maths():
    from fla.modules import FusedRMSNormGated, RMSNorm
    from fla.modules.norm.layernorm import rms_norm_ref

    from trainer.families.gla import _torch_rms_norm

    x, residual, g = torch.randn(3, 7, 16), torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    norm = RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    y, summed = _torch_rms_norm(norm, x, residual, prenorm=True)
    y_ref, summed_ref = rms_norm_ref(x, norm.weight, None, residual, eps=1e-6, prenorm=True, upcast=True)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(summed, summed_ref)
    gated = FusedRMSNormGated(16, eps=1e-6)
    expected = rms_norm_ref(x, gated.weight, None, eps=1e-6, upcast=True) * torch.nn.functional.silu(g)
    from trainer.families.gla import _swap_to_torch

    holder = torch.nn.Sequential(gated)
    assert _swap_to_torch(holder, "swish") == []
    torch.testing.assert_close(holder[0](x, g), expected)


@pytest.mark.slow
@pytest.mark.parametrize("variant, init", VARIANTS)
def test_gla_lora_variants_train(tmp_path, variant, init):
    check_variant_trains(tmp_path, "tiny-gla", TARGETS, variant, init)


@pytest.mark.slow
def test_gla_dora_on_4bit_layers_trains(tmp_path):
    check_variant_trains(tmp_path, "tiny-gla", TARGETS[:-1], "dora", "default", method="qlora")


def test_gla_qlora_quantizes_every_linear_and_keeps_gradients_right(tmp_path):
    import bitsandbytes as bnb

    from trainer.model.loading import load_for_training

    config = family_config(
        tmp_path, "tiny-gla", TARGETS[:-1], {"training": {"method": "qlora"}, "lora": {"dropout": 0.0}}
    )
    model = load_for_training(load_config(config), torch.device("cpu")).model
    four_bit = {
        n.removesuffix(".base_layer").split(".")[-1]
        for n, m in model.named_modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }
    # every projection and MLP linear, gk_proj's two (named 0 and 1); lm_head stays 16/32-bit
    assert four_bit == {
        "q_proj",
        "k_proj",
        "v_proj",
        "g_proj",
        "o_proj",
        "0",
        "1",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert model.base_model.model.config.fuse_swiglu is False  # fused SwiGLU would read down_proj's weight
    rows = pack([(list(range(4, 40)), list(range(4, 40)))] * 3, 48, 0)
    check_qlora_gradients(model, collate(rows, 0), expected_tensors=2 * 2 * 5, every_one_nonzero=False)


@pytest.mark.slow
def test_gla_pissa_on_4bit_is_exit_2_before_loading(tmp_path, capsys, monkeypatch):
    from trainer.model import loading

    monkeypatch.setattr(loading, "load_base_model", lambda *a, **k: pytest.fail("weights loaded first"))
    config = family_config(
        tmp_path, "tiny-gla", TARGETS, {"training": {"method": "qlora"}, "lora": {"init": "pissa"}}
    )
    assert cli("train", "--config", str(config)) == 2
    assert error_line(capsys.readouterr().err).startswith(
        "error: lora.init: pissa factorises the base weights"
    )


def test_gla_without_fla_is_a_clear_error(monkeypatch):
    import builtins

    from trainer.families import ModelLoadError
    from trainer.families.gla import configure

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name == "fla" or name.startswith("fla."):
            raise ImportError("No module named 'fla'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fla)
    with pytest.raises(ModelLoadError, match=r"needs flash-linear-attention \(pip install -e \.\[gla\]\)"):
        configure(object(), None)


@pytest.mark.slow
def test_example_yaml_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    check_example_yaml_runs(tmp_path, "tiny-gla")


@pytest.mark.parametrize(
    ("mixed_precision", "dtype", "cuda_bf16", "mode"),
    [
        ("no", "fp32", True, "fused_recurrent"),  # an fp32 run: the exact kernel
        ("no", "auto", False, "fused_recurrent"),  # auto weights are fp32 without bf16 support
        ("bf16", "fp32", True, "chunk"),  # bf16 products: TF32 inside chunk_gla is below bf16's rounding
        ("no", "auto", True, "chunk"),  # auto weights are bf16 on a bf16 GPU
        ("no", "bf16", True, "chunk"),
    ],
)
def test_an_fp32_gla_run_takes_the_recurrent_kernel(monkeypatch, mixed_precision, dtype, cuda_bf16, mode):
    """chunk_gla's fp32 products run in TF32 (1.2e-3 off fla's fp32 recurrence on an H100, which a deep
    model amplifies into gradients 5-25% apart); fused_recurrent_gla is exact to fp32 (4e-7 there)."""
    from trainer.families import gla

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    cfg = load_config(REPO / "configs" / "tiny-gla.yaml")
    cfg.training.mixed_precision = mixed_precision
    cfg.model.dtype = dtype
    assert gla.configure(_gla_config(), cfg).attn_mode == mode


def _gla_config():
    from fla.models import GLAConfig

    return GLAConfig(hidden_size=64, num_hidden_layers=1, num_heads=2, vocab_size=128)
