"""LoRA-GA (every family) and SDLoRA (Mamba-1, Mamba-2): the step-0 identity, the first update's direction,
the frozen SSM entries, refusals, and exact resume after SIGKILL in stage two (trainer/peft_methods)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.families.helpers import (
    CpuAccelerator,
    assert_resumed_exactly,
    cli,
    error_line,
    events,
    family_config,
    random_batch,
    train_in_process,
    train_killed_and_resumed,
)
from trainer import runfolder
from trainer.config import ConfigError, load_config
from trainer.families import ModelLoadError
from trainer.peft_methods import lora_ga, sdlora
from trainer.training.step import forward_loss

TARGETS = {
    "tiny-llama": ["q_proj", "v_proj", "up_proj", "lm_head"],
    "tiny-mamba2": ["in_proj", "lm_head"],
    "tiny-mamba": ["in_proj", "x_proj", "lm_head"],
    "tiny-gla": ["q_proj", "v_proj", "g_proj", "lm_head"],
}
PACKING = {"tiny-llama": True, "tiny-mamba2": False, "tiny-mamba": False, "tiny-gla": True}


def loaded_model(tmp_path, model: str, lora: dict, training: dict | None = None):
    """The PEFT model exactly as training builds it (random init from the config, fp32 on a CPU)."""
    from trainer.model.loading import load_for_training

    extra = {"lora": {"dropout": 0.0, **lora}, "model": {"dtype": "fp32"}, "training": training or {}}
    cfg = load_config(family_config(tmp_path, model, TARGETS[model], extra))
    return cfg, load_for_training(cfg, torch.device("cpu"))


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
        return model(**inputs).logits.float()


def loss_fn(model, batch, accelerator):
    return forward_loss(model, batch, accelerator)


# ---------------------------------------------------------------- LoRA-GA


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mamba2", "tiny-mamba", "tiny-gla"])
def test_lora_ga_leaves_the_step_zero_output_unchanged(tmp_path, model):
    cfg, loaded = loaded_model(tmp_path, model, {"init": "lora_ga", "r": 4})
    peft = loaded.model
    batches = [random_batch(packing=PACKING[model], seed=s) for s in range(2)]
    base = logits(peft, batches[0])  # PEFT's default init: B = 0, the base model's output
    weights = {n: p.detach().clone() for n, p in peft.named_parameters() if not p.requires_grad}
    tensors, event = lora_ga.initialise(peft, cfg, batches, loss_fn, CpuAccelerator())
    after = logits(peft, batches[0])
    assert torch.allclose(after, base, atol=1e-4, rtol=1e-5), (after - base).abs().max()
    assert event["step0_abs_diff"] < 1e-5 and event["step0_ok"]
    assert event["offset"] == {"side_term": event["modules"]}
    # the offset is the adapter's own frozen copy: no base weight changed
    assert all(torch.equal(p, weights[n]) for n, p in peft.named_parameters() if not p.requires_grad)
    with peft.disable_adapter():  # the base model itself
        assert torch.equal(logits(peft, batches[0]), base)
    # not vacuous: the adapters are far from zero, and so is what they add without the offset
    layers = lora_ga.lora_layers(peft)
    assert len(layers) == event["modules"] and all(tensors[f"{n}.B0"].abs().sum() > 0 for n in layers)
    for layer in layers.values():
        layer.lora_ga_B0.zero_()
    assert (logits(peft, batches[0]) - base).abs().max() > 1e-2


class Bf16CpuAccelerator(CpuAccelerator):
    """The run's bf16 autocast, on a CPU."""

    @staticmethod
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("model", ["tiny-mamba2", "tiny-llama"])
def test_lora_ga_step_zero_check_holds_in_bf16(tmp_path, model):
    """bf16 weights under bf16 autocast, as on a GPU: s B0 A0 is about as large as W, so an offset written
    into the bf16 weight (rounded) and a bf16 adapter output added to the base's (rounded again) moved the
    step-0 loss by ~1e-3 of itself here (2e-2 on an H100). The offset must cancel the adapter exactly."""
    extra = {"lora": {"init": "lora_ga", "r": 8, "alpha": 16, "dropout": 0.0}, "model": {"dtype": "bf16"}}
    cfg = load_config(family_config(tmp_path, model, TARGETS[model], extra))
    from trainer.model.loading import load_for_training

    peft = load_for_training(cfg, torch.device("cpu")).model
    assert peft.get_base_model().get_output_embeddings().base_layer.weight.dtype == torch.bfloat16
    batches = [random_batch(packing=PACKING[model], seed=s, width=48) for s in range(2)]
    acc = Bf16CpuAccelerator()
    with acc.autocast():
        base = logits(peft, batches[0])
    _, event = lora_ga.initialise(peft, cfg, batches, loss_fn, acc)
    with acc.autocast():
        after = logits(peft, batches[0])
    assert event["step0_ok"] and event["step0_abs_diff"] <= event["step0_tolerance"], event
    assert event["step0_tolerance"] == pytest.approx(1e-4 * event["step0_loss_base"])
    assert (after - base).abs().max() <= 1e-3 * base.abs().max(), (after - base).abs().max()


def full_gradients(peft, layers, batch) -> dict[str, torch.Tensor]:
    """The gradient of each target's base weight, as full fine-tuning would see it."""
    weights = {n: layer.get_base_layer().weight for n, layer in layers.items()}
    trainable = {p: p.requires_grad for p in peft.parameters()}
    for p in trainable:
        p.requires_grad_(False)
    for w in weights.values():
        w.requires_grad_(True)
    peft.train()
    ce_sum, _ = forward_loss(peft, batch, CpuAccelerator())
    grads = torch.autograd.grad(ce_sum, list(weights.values()))
    for p, flag in trainable.items():
        p.requires_grad_(flag)
    return {n: g.detach() for n, g in zip(weights, grads)}


def first_update_cosines(peft, layers, batch) -> dict[str, float]:
    """One SGD step on the adapters; the cosine of each layer's change s(BA) with -G of full fine-tuning."""
    full = full_gradients(peft, layers, batch)
    start = {
        n: (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach().clone()
        for n, layer in layers.items()
    }
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    optimizer.zero_grad()
    ce_sum, _ = forward_loss(peft, batch, CpuAccelerator())
    ce_sum.backward()
    optimizer.step()
    cosines = {}
    for n, layer in layers.items():
        change = layer.lora_B["default"].weight @ layer.lora_A["default"].weight - start[n]
        cosines[n] = float(
            torch.nn.functional.cosine_similarity(change.detach().flatten(), -full[n].flatten(), dim=0)
        )
    return cosines


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mamba2"])
def test_lora_ga_first_update_follows_full_fine_tuning_better_than_default_init(tmp_path, model):
    """The first update of a LoRA-GA adapter is the best rank-2r approximation of the full gradient; a
    default init (B = 0, A random) sees it through r random directions. Same batch for estimate and step."""
    batch = random_batch(packing=PACKING[model], seed=3)
    cfg, loaded = loaded_model(tmp_path, model, {"init": "lora_ga", "r": 4})
    lora_ga.initialise(loaded.model, cfg, [batch], loss_fn, CpuAccelerator())
    ga = first_update_cosines(loaded.model, lora_ga.lora_layers(loaded.model), batch)
    (tmp_path / "default").mkdir()
    _, default = loaded_model(tmp_path / "default", model, {"r": 4})
    plain = first_update_cosines(default.model, lora_ga.lora_layers(default.model), batch)
    assert sorted(ga) == sorted(plain)
    for name in ga:
        assert ga[name] > plain[name] + 0.1, (name, ga[name], plain[name])
    assert sum(ga.values()) / len(ga) > 0.5, ga


def test_lora_ga_factors_are_the_papers_split_and_scale():
    """A: the top r right singular vectors; B: the next r left ones; both times d_out^(1/4)/sqrt(gamma)."""
    torch.manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(24, 24))
    V, _ = torch.linalg.qr(torch.randn(10, 10))
    S = torch.tensor([9.0, 7, 5, 3, 2, 1, 0.5, 0.25, 0.1, 0.05])
    grad = U[:, :10] @ torch.diag(S) @ V.t()
    A0, B0 = lora_ga.factorise(grad, r=2, gamma=4.0, seed=0)
    scale = 24**0.25 / 2.0
    assert torch.allclose(((A0 / scale) @ V[:, :2]).abs(), torch.eye(2), atol=1e-3)  # signs are arbitrary
    assert torch.allclose(((B0 / scale).t() @ U[:, 2:4]).abs(), torch.eye(2), atol=1e-3)


def test_lora_ga_as_plain_lora_reproduces_the_offset_model():
    """Export's conversion: s(BA - B0A0) as one rank-2r adapter with the same scaling."""
    torch.manual_seed(1)
    A, B, A0, B0 = torch.randn(3, 8), torch.randn(5, 3), torch.randn(3, 8), torch.randn(5, 3)
    adapter = {"base_model.model.x.lora_A.weight": A, "base_model.model.x.lora_B.weight": B}
    plain = lora_ga.as_plain_lora(adapter, {"x.A0": A0, "x.B0": B0})
    merged = plain["base_model.model.x.lora_B.weight"] @ plain["base_model.model.x.lora_A.weight"]
    assert torch.allclose(merged, B @ A - B0 @ A0, atol=1e-5)


def test_lora_ga_refusals(tmp_path):
    base = {"lora": {"init": "lora_ga"}}
    for extra, words in (
        ({"lora": {"init": "lora_ga", "variant": "dora"}}, "lora.init: lora_ga sets A and B"),
        ({"lora": {"init": "lora_ga", "method": "sdlora"}}, "lora.init: lora_ga does not combine"),
        ({**base, "training": {"method": "full"}}, "lora.init: lora_ga works on LoRA adapters"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config(family_config(tmp_path, "tiny-mamba2", ["in_proj"], extra))


# ---------------------------------------------------------------- SDLoRA


def stage_one(peft, cfg, model_type, batches):
    base = peft.get_base_model()
    params = sdlora.params_for(cfg, model_type)
    result = sdlora.run_stage_one(
        peft, base, model_type, params, lambda i: batches, loss_fn, CpuAccelerator(), cfg
    )
    return base, params, result


@pytest.mark.parametrize("model, model_type", [("tiny-mamba", "mamba"), ("tiny-mamba2", "mamba2")])
def test_sdlora_trains_only_the_selected_ssm_entries(tmp_path, model, model_type):
    from trainer.training.optim import make_optimizer

    lora = {"method": "sdlora", "sdlora_channels": 0.25, "sdlora_states": 0.25, "sdlora_stage_one_steps": 2}
    # weight decay on: it must not reach the SSM tensors, whose frozen entries get no gradient
    cfg, loaded = loaded_model(tmp_path, model, lora)
    cfg.optimization.weight_decay = 0.1
    peft = loaded.model
    batches = [random_batch(packing=False, seed=s) for s in range(2)]
    before_all = {n: p.detach().clone() for n, p in peft.named_parameters()}
    base, params, result = stage_one(peft, cfg, model_type, batches)
    for name, p in peft.named_parameters():  # stage one only chooses: every weight is back
        assert torch.equal(p, before_all[name]), name
    masks = sdlora.masks(base, model_type, params, result["layers"])
    assert {t.group for t in sdlora.targets(base, model_type, params)} == set(
        sdlora.DEFAULT_PARAMS[model_type]
    )
    sdlora.train_selected(base, masks)
    start = {n: sdlora.resolve(base, n).detach().clone() for n in masks}
    optimizer = make_optimizer(peft, cfg, on_cuda=False)
    peft.train()
    for _ in range(3):
        optimizer.zero_grad()
        for batch in batches:
            ce_sum, _ = forward_loss(peft, batch, CpuAccelerator())
            ce_sum.backward()
        optimizer.step()
    for name, mask in masks.items():
        now = sdlora.resolve(base, name).detach()
        assert 0 < int(mask.sum()) < mask.numel(), name
        assert torch.equal(now[~mask], start[name][~mask]), f"{name}: unselected entries moved"
        assert (now[mask] != start[name][mask]).all(), f"{name}: a selected entry did not train"
    layer = result["layers"][0]
    assert len(layer["channels"]) == sdlora.count(0.25, layer["total_channels"])


def test_sdlora_selects_the_channels_and_states_that_moved_most(tmp_path):
    """The paper's rule on A: channels by the summed squared change of their row, then states per channel."""
    cfg, loaded = loaded_model(tmp_path, "tiny-mamba", {"method": "sdlora", "sdlora_channels": 0.25})
    base = loaded.model.get_base_model()
    prefix, mixer = sdlora.mixers(base)[0]
    before = {f"{n}.A_log": m.A_log.detach().clone() for n, m in sdlora.mixers(base)}
    with torch.no_grad():
        mixer.A_log[7, 3] += 5.0  # channel 7 moved most, in state 3
        mixer.A_log[2, :] += 0.5  # channel 2 next, every state a little
        mixer.A_log[2, 5] += 1.0
    selection = sdlora.select(base, "mamba", ("A_log",), before, cfg)
    channels = selection[0]["channels"]
    assert len(channels) == 32 and {2, 7} <= set(channels)
    states = dict(zip(channels, selection[0]["states"]))
    assert 3 in states[7] and 5 in states[2] and len(states[7]) == sdlora.count(0.05, 8)


def test_sdlora_refusals(tmp_path):
    from trainer.model.loading import load_for_training

    with pytest.raises(ModelLoadError, match="^lora.method: sdlora selects channels and states.*GLA has no"):
        cfg = load_config(family_config(tmp_path, "tiny-gla", ["q_proj"], {"lora": {"method": "sdlora"}}))
        load_for_training(cfg, torch.device("cpu"))
    with pytest.raises(
        ModelLoadError, match="^lora.method: sdlora needs a Mamba or Mamba-2 model.*causal/llama"
    ):
        cfg = load_config(family_config(tmp_path, "tiny-llama", ["q_proj"], {"lora": {"method": "sdlora"}}))
        load_for_training(cfg, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="BC is Mamba-1's x_proj"):
        extra = {"lora": {"method": "sdlora", "sdlora_params": ["A_log", "BC"]}}
        load_for_training(
            load_config(family_config(tmp_path, "tiny-mamba2", ["in_proj"], extra)), torch.device("cpu")
        )
    with pytest.raises(ConfigError, match="lora.method: sdlora works on LoRA adapters"):
        extra = {"lora": {"method": "sdlora"}, "training": {"method": "full"}}
        load_config(family_config(tmp_path, "tiny-mamba", ["in_proj"], extra))


def test_sdlora_refusal_through_the_cli_is_one_line(tmp_path, capsys):
    config = family_config(tmp_path, "tiny-gla", ["q_proj"], {"lora": {"method": "sdlora"}})
    assert cli("train", "--config", str(config)) == 2
    assert error_line(capsys.readouterr().err).startswith(
        "error: lora.method: sdlora selects channels and states"
    )


# ---------------------------------------------------------------- whole runs


def merged_equals_trained(tmp_path, run, checkpoint: str) -> None:
    """``export --merge`` folds the method in: its logits are the trained model's (as evaluate loads it)."""
    import transformers

    from trainer.model.loading import load_for_training
    from trainer.training.checkpointing import load_checkpoint_weights

    out = tmp_path / "merged"
    assert cli("export", str(run / checkpoint), "--out", str(out), "--merge", "--dtype", "fp32") == 0
    # transformers' class by name: once `import fla` has run in this process (a GLA test before this one),
    # the Auto classes map mamba/mamba2 to fla's own Mamba, whose Triton norm has no CPU driver
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    merged = getattr(transformers, architecture).from_pretrained(str(out), dtype=torch.float32)
    cfg = load_config(run / runfolder.CONFIG_YAML)
    loaded = load_for_training(cfg, torch.device("cpu"))
    load_checkpoint_weights(loaded.model, run / checkpoint, UnwrappingAccelerator())
    batch = random_batch(packing=False, seed=5)
    trained = logits(loaded.model, batch)
    assert torch.allclose(logits(merged, batch), trained, atol=1e-4, rtol=1e-4)
    with loaded.model.disable_adapter():
        assert (logits(loaded.model, batch) - trained).abs().max() > 1e-3  # the adapter mattered


class UnwrappingAccelerator(CpuAccelerator):
    """What load_checkpoint_weights needs besides the device."""

    unwrap_model = staticmethod(lambda model: model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, lora",
    [
        (
            "tiny-mamba",
            {"method": "sdlora", "sdlora_channels": 0.1, "sdlora_states": 0.25, "sdlora_stage_one_steps": 3},
        ),
        ("tiny-mamba2", {"init": "lora_ga", "lora_ga_batches": 2}),
    ],
)
def test_resume_after_sigkill_is_exact_and_never_redoes_the_first_stage(tmp_path, capsys, model, lora):
    """SDLoRA in stage two (Mamba-1) and LoRA-GA (Mamba-2): killed after checkpoint-4, resumed, same losses;
    the selection / init is made once; the export folds the method into the base."""
    extra = {"lora": lora}
    reference = train_in_process(family_config(tmp_path, model, TARGETS[model], extra, output="reference"))
    run = tmp_path / "run"
    train_killed_and_resumed(family_config(tmp_path, model, TARGETS[model], extra), run, capsys)
    assert_resumed_exactly(run, reference)
    name, event = (
        (runfolder.SDLORA_SELECTION, "sdlora_selection")
        if "method" in lora
        else (runfolder.LORA_GA_INIT, "lora_ga_init")
    )
    assert len(events(run, event)) == 1  # made by the killed process, read back by the resume
    if name == runfolder.LORA_GA_INIT:
        assert (run / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    else:
        layers = [json.loads((r / name).read_text())["layers"] for r in (run, tmp_path / "reference")]
        assert layers[0] == layers[1]
    final = run / "final-checkpoint-8"
    method = json.loads((final / runfolder.PEFT_METHOD_JSON).read_text())
    assert method["method"] == lora.get("method", "lora") and method["init"] == lora.get("init", "default")
    assert (run / runfolder.BEST_ADAPTER_DIR / runfolder.PEFT_METHOD_TENSORS).is_file()
    merged_equals_trained(tmp_path, run, "final-checkpoint-8")
    if "method" in lora:
        out = tmp_path / "adapter-only"
        assert cli("export", str(final), "--out", str(out)) == 2
        assert "is SDLoRA" in capsys.readouterr().err


def test_sdlora_bc_keeps_x_proj_out_of_4bit(tmp_path):
    """QLoRA: Mamba-1's x_proj holds trained entries under BC, so bitsandbytes must leave it 16-bit."""
    from trainer.families import mamba
    from trainer.model.loading import load_hf_config

    plain = load_config(family_config(tmp_path, "tiny-mamba", ["in_proj"]))
    sd = load_config(family_config(tmp_path, "tiny-mamba", ["in_proj"], {"lora": {"method": "sdlora"}}))
    hf_config = load_hf_config(plain)
    if mamba.kernel_path(hf_config) != mamba.KERNEL_MAMBA_SSM:
        assert "x_proj" not in mamba.quantization_skip(hf_config, plain)
    assert "x_proj" in mamba.quantization_skip(hf_config, sd)


def test_lora_ga_on_a_4bit_base_keeps_the_offset_as_a_side_term(tmp_path):
    """QLoRA (bitsandbytes' CPU NF4): the gradient comes through the hooks, the offset cannot go into the
    4-bit weight, so it is a side term, and the step-0 output is still the base's."""
    pytest.importorskip("bitsandbytes")
    extra = {
        "training": {"method": "qlora"},
        "lora": {"init": "lora_ga", "dropout": 0.0, "r": 4},
        "quantization": {"compute_dtype": "fp32"},
    }
    cfg = load_config(family_config(tmp_path, "tiny-llama", ["q_proj", "v_proj"], extra))
    from trainer.model.loading import load_for_training

    peft = load_for_training(cfg, torch.device("cpu")).model
    batch = random_batch(packing=True, seed=1)
    base = logits(peft, batch)
    _, event = lora_ga.initialise(peft, cfg, [batch], loss_fn, CpuAccelerator())
    assert event["offset"] == {"side_term": 4}
    assert torch.allclose(logits(peft, batch), base, atol=1e-4, rtol=1e-5)
    layer = next(iter(lora_ga.lora_layers(peft).values()))
    assert lora_ga.is_4bit(layer.get_base_layer().weight) and layer.lora_B["default"].weight.abs().sum() > 0
