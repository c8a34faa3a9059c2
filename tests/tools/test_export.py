"""``export``: adapters alone or merged into their base; the merged model loads with plain transformers
and generates what base + adapter generated.

Most run folders here are made in-process with the trainer's own model loader and a LoRA adapter
given random weights (so merging visibly changes the model); one comes from a real training run.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import REPO, TINY, deep_merge, run_trainer
from trainer import runfolder
from trainer.cli import main as cli


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread; two threads on a shared 2-core machine spin for ages."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY_CONFIGS = sorted(p.parent.name for p in (REPO / "configs").glob("tiny-*/config.json"))
PROMPT = "the cat sat on"


def build_cfg(model_dir: str, method: str = "lora", **lora):
    from trainer.config import build_config

    raw = deep_merge(
        TINY,
        {
            "model": {"name_or_path": str(REPO / "configs" / model_dir), "random_init": True},
            "training": {"method": method, "seed": 7},
            "lora": {"target_modules": None, "dropout": 0.0, **lora},
        },
    )
    return build_config(raw)


def family_extras(model_dir: str) -> dict:
    """LoRA settings per tiny model: the MoE also gets adapters on its fused expert weights."""
    if model_dir == "tiny-moe":
        return {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    return {}


def make_run(tmp_path: Path, model_dir: str, method_in_config: str = "lora") -> tuple[Path, dict]:
    """A run folder as the trainer writes it, with an adapter whose weights are far from zero.

    Returns the checkpoint and what base + adapter produce, computed before anything is saved.
    """
    from trainer.model.loading import load_for_training

    cfg = build_cfg(model_dir, **family_extras(model_dir))
    loaded = load_for_training(cfg, torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.eval()
    reference = outputs(model, tokenizer)
    with model.disable_adapter():
        reference["base_logits"] = outputs(model, tokenizer, generate=False)["logits"]

    run_dir = tmp_path / f"run-{model_dir}"
    checkpoint = run_dir / "checkpoint-4"
    model.save_pretrained(checkpoint, save_embedding_layers=False)
    tokenizer.save_pretrained(checkpoint)
    state = {"step": 4, "metric": "eval_loss", "metric_value": 5.25}
    (checkpoint / runfolder.TRAINER_STATE).write_text(json.dumps(state))
    cfg.training.method = method_in_config
    (run_dir / runfolder.CONFIG_YAML).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    log = runfolder.RunLog(run_dir)
    log.update_run(run_id="run-test", status="finished", step=4, total_steps=4, method=method_in_config)
    for step, loss in ((2, 5.5), (4, 5.25)):
        log.write(runfolder.EVAL_LOG, {"step": step, "eval_loss": loss, "perplexity": 1.0, "eval_tokens": 10})
    log.close()
    return checkpoint, reference


def outputs(model, tokenizer, generate: bool = True) -> dict:
    """Logits for a prompt, and the tokens greedy decoding continues it with."""
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        result = {"logits": model(input_ids=ids).logits.float()}
        if generate:
            tokens = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            result["tokens"] = tokens[0, ids.shape[1] :].tolist()
    return result


def load_plain(path: Path):
    """What a user without this kit does: the class config.json names, from the library that defines it
    (transformers; fla for GLA), and the tokenizer through AutoTokenizer."""
    import transformers
    from transformers import AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    architecture = config["architectures"][0]
    if config["model_type"] == "gla":
        import fla.models

        cls = getattr(fla.models, architecture)
    else:
        cls = getattr(transformers, architecture)
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if config["model_type"] == "gla" and not torch.cuda.is_available():
        # fla's GLA kernels are Triton (GPU only): run the same weights on the family's torch path.
        from trainer.config import ModelConfig
        from trainer.families import family_for

        family = family_for("gla")
        hf_config = family.configure(model.config, build_cfg("tiny-gla"))
        model = family.load(ModelConfig(name_or_path=str(path)), hf_config)
    return model.eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("model_dir", TINY_CONFIGS)
def test_merged_export_generates_like_base_plus_adapter(tmp_path, model_dir):
    checkpoint, reference = make_run(tmp_path, model_dir)
    out = tmp_path / "merged"
    assert cli(["export", str(checkpoint), "--out", str(out), "--merge", "--dtype", "fp32"]) == 0

    assert (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    assert not (out / "adapter_config.json").exists()
    assert (out / "generation_config.json").is_file()
    model, tokenizer = load_plain(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    got = outputs(model, tokenizer)
    assert got["tokens"] == reference["tokens"]
    torch.testing.assert_close(got["logits"], reference["logits"], atol=2e-4, rtol=1e-4)
    # The adapter mattered: without it the logits are far from these.
    assert (reference["base_logits"] - reference["logits"]).abs().max() > 0.05


def test_qlora_run_merges_into_an_unquantized_base_and_says_so(tmp_path):
    checkpoint, reference = make_run(tmp_path, "tiny-llama", method_in_config="qlora")
    out = tmp_path / "merged"
    args = [
        "export",
        str(checkpoint),
        "--out",
        str(out),
        "--merge",
        "--dtype",
        "fp32",
        "--max-shard-size",
        "1MB",
    ]
    assert cli(args) == 0

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    from safetensors import safe_open

    shards = sorted(
        set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    )
    assert len(shards) >= 2 and all((out / shard).stat().st_size <= 1_200_000 for shard in shards)
    dtypes = set()
    for shard in shards:
        with safe_open(str(out / shard), "pt") as weights:
            dtypes |= {weights.get_slice(k).get_dtype() for k in weights.keys()}
    assert dtypes == {"F32"}, dtypes
    model, tokenizer = load_plain(out)
    got = outputs(model, tokenizer)
    assert got["tokens"] == reference["tokens"]
    torch.testing.assert_close(got["logits"], reference["logits"], atol=2e-4, rtol=1e-4)
    card = (out / "README.md").read_text()
    assert "QLoRA on a 4-bit (NF4) base" in card and "loaded again unquantized in float32" in card


def test_adapter_export_in_bf16_with_tokenizer_generation_config_and_card(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint, reference = make_run(tmp_path, "tiny-llama")
    out = tmp_path / "adapter"
    assert (
        cli(["export", str(checkpoint), "--out", str(out), "--dtype", "bf16", "--base", "org/tiny-base"]) == 0
    )

    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_config.yaml",
    ]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny-base"
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as weights:
        assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"BF16"}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    card = (out / "README.md").read_text()
    assert "base_model: org/tiny-base" in card
    assert "best eval | eval_loss 5.2500 at step 4" in card
    assert "2352 training records" not in card  # no data_report event in this run folder
    assert "data/tiny_corpus.jsonl" in card and "r=8, alpha=16" in card

    # The exported adapter on the same base reproduces base + adapter (to bf16 precision).
    torch.manual_seed(7)
    from transformers import AutoConfig

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama"))
    model = PeftModel.from_pretrained(base, str(out)).float().eval()
    from transformers import AutoTokenizer

    got = outputs(model, AutoTokenizer.from_pretrained(out))
    torch.testing.assert_close(got["logits"], reference["logits"], atol=0.1, rtol=0.05)


def test_export_bad_input_is_one_line(tmp_path, capsys):
    assert cli(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "CHECKPOINT: path not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no adapter" in capsys.readouterr().err
    checkpoint, _ = make_run(tmp_path, "tiny-llama")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert cli(["export", str(checkpoint), "--out", str(tmp_path / "busy")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    # Without the run's config.yaml, a random-init base has no weights to merge into: say --base.
    (checkpoint.parent / runfolder.CONFIG_YAML).unlink()
    assert cli(["export", str(checkpoint), "--out", str(tmp_path / "o2"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "no weights in" in err and "--base" in err
    assert not (tmp_path / "o2").exists()
    assert cli(["export", str(checkpoint), "--out", str(tmp_path / "o3"), "--max-shard-size", "big"]) == 2
    assert "--max-shard-size: expected a size such as 500MB" in capsys.readouterr().err


@pytest.mark.slow
def test_real_run_folder_exports_its_best_adapter_merged(tmp_path):
    """A real training run, exported by its run folder: the best adapter, merged, equals base + adapter."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = deep_merge(
        TINY,
        {
            "paths": {"output_dir": str(tmp_path / "run")},
            "model": {"name_or_path": str(REPO / "configs" / "tiny-llama")},
            "training": {"max_steps": 4, "save_steps": 2},
            "performance": {"torch_threads": 1},
            "eval": {"interval": 2},
        },
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    result = run_trainer("train", "--config", str(tmp_path / "cfg.yaml"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]

    out = tmp_path / "export"
    assert cli(["export", str(tmp_path / "run"), "--out", str(out), "--merge", "--dtype", "fp32"]) == 0
    merged, tokenizer = load_plain(out)

    # Rebuild the base independently, as training did: seed, then random init from config.json.
    torch.manual_seed(42)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama"))
    reference = PeftModel.from_pretrained(base, str(tmp_path / "run" / "best-adapter")).eval()
    got, want = outputs(merged, tokenizer), outputs(reference, tokenizer)
    assert got["tokens"] == want["tokens"]
    torch.testing.assert_close(got["logits"], want["logits"], atol=2e-4, rtol=1e-4)

    evals = list(runfolder.iter_records(tmp_path / "run" / "logs" / "eval_log.jsonl"))
    best = min(r["eval_loss"] for r in evals)
    card = (out / "README.md").read_text()
    assert f"best eval | eval_loss {best:.4f}" in card
    assert "seed 42" in card and "training records" in card


def test_push_to_hub_uploads_the_export_and_refuses_offline(tmp_path, monkeypatch, capsys):
    """--push-to-hub against the local Hub server (tests/hub_server.py): create the repo, commit every file."""
    from huggingface_hub import constants

    from tests.tools.hub_server import FakeHub

    checkpoint, _ = make_run(tmp_path, "tiny-llama")
    monkeypatch.setenv("HF_TOKEN", "hf_push_test_token")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    with FakeHub({}, token="hf_push_test_token") as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        out = tmp_path / "pushed"
        args = ["export", str(checkpoint), "--out", str(out), "--push-to-hub", "me/tiny-adapter", "--private"]
        assert cli(args) == 0
    assert f"pushed to {hub.url}/me/tiny-adapter" in capsys.readouterr().out
    assert hub.created == [{"name": "tiny-adapter", "organization": "me", "visibility": "private"}]
    [commit] = hub.commits
    assert commit["repo"] == "me/tiny-adapter"
    assert commit["files"] == {p.name: p.read_bytes() for p in out.iterdir()}

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli(["export", str(checkpoint), "--out", str(tmp_path / "offline"), "--push-to-hub", "me/x"]) == 2
    assert "HF_HUB_OFFLINE is set; the export is on disk" in capsys.readouterr().err
    assert (tmp_path / "offline" / "adapter_model.safetensors").is_file()


def test_full_fine_tune_checkpoint_exports_its_own_weights(tmp_path):
    """method full: the checkpoint holds the whole model; export saves it (not the base) for transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trainer.config import build_config

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama")
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-llama")
    run_dir = tmp_path / "run-full"
    checkpoint = run_dir / "final-checkpoint-6"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    model_cfg = {"name_or_path": str(REPO / "configs" / "tiny-llama"), "random_init": True}
    cfg = build_config(deep_merge(TINY, {"training": {"method": "full"}, "model": model_cfg}))
    (run_dir / runfolder.CONFIG_YAML).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    reference = outputs(model, tokenizer)

    out = tmp_path / "full"
    assert cli(["export", str(run_dir), "--out", str(out), "--dtype", "fp32"]) == 0
    exported, exported_tokenizer = load_plain(out)
    got = outputs(exported, exported_tokenizer)
    assert got["tokens"] == reference["tokens"]
    torch.testing.assert_close(got["logits"], reference["logits"])
    assert "full fine-tuned model" in (out / "README.md").read_text()


def test_merged_export_files_follow_the_umask(tmp_path):
    """transformers writes model.safetensors through a 0600 temporary file; the export must not keep that."""
    checkpoint, _ = make_run(tmp_path, "tiny-llama")
    out = tmp_path / "merged"
    previous = os.umask(0o027)
    try:
        assert cli(["export", str(checkpoint), "--out", str(out), "--merge", "--dtype", "fp32"]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and "README.md" in modes
    assert set(modes.values()) == {0o640}, modes
