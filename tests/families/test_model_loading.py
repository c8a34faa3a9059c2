"""Model loading: local folders with real weights, family by model_type, clear errors for missing files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import REPO, run_trainer
from trainer.config import load_config
from trainer.families import ModelLoadError, family_for
from trainer.model.loading import load_for_training


@pytest.fixture
def saved_model(tmp_path):
    """A tiny Llama saved with real weights and its tokenizer, as a downloaded model folder looks."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "tiny-llama-weights"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama")
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-llama").save_pretrained(folder)
    return folder


def test_local_folder_loads_its_weights(write_config, saved_model):
    from safetensors.torch import load_file

    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(saved_model), "random_init": False},
                "training": {"method": "full"},
            }
        )
    )
    loaded = load_for_training(cfg, torch.device("cpu"))
    assert loaded.family.name == "causal" and loaded.model_type == "llama"
    stored = load_file(str(saved_model / "model.safetensors"))
    assert torch.equal(
        loaded.model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
        stored["model.layers.0.self_attn.q_proj.weight"],
    )
    assert loaded.report["trainable_params"] == loaded.report["total_params"]


@pytest.mark.slow
def test_missing_weights_names_the_folder(write_config, saved_model):
    (saved_model / "model.safetensors").unlink()
    result = run_trainer(
        "train",
        "--config",
        str(write_config({"model": {"name_or_path": str(saved_model), "random_init": False}})),
    )
    assert result.returncode == 2
    assert f"model.name_or_path: no weights in {saved_model}" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_shard_is_named(write_config, saved_model):
    (saved_model / "model.safetensors").rename(saved_model / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (saved_model / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = load_config(write_config({"model": {"name_or_path": str(saved_model), "random_init": False}}))
    with pytest.raises(ModelLoadError, match="weight shard missing: .*model-00002-of-00002.safetensors"):
        load_for_training(cfg, torch.device("cpu"))


def test_missing_tokenizer_is_named(write_config, tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(REPO / "configs" / "tiny-llama", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    cfg = load_config(write_config({"model": {"name_or_path": str(folder)}}))
    with pytest.raises(ModelLoadError, match=f"no usable tokenizer in '{folder}'"):
        load_for_training(cfg, torch.device("cpu"))


@pytest.mark.slow
def test_hub_id_offline_is_one_clear_line(write_config, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_trainer(
        "train",
        "--config",
        str(write_config({"model": {"name_or_path": "some-org/not-cached-model", "random_init": False}})),
    )
    assert result.returncode == 2
    assert "model.name_or_path: cannot load config for 'some-org/not-cached-model'" in result.stderr


def test_family_comes_from_model_type_not_name():
    assert family_for("qwen2_moe").name == "causal"
    assert family_for("llama").name == "causal"
    with pytest.raises(ModelLoadError, match="model.family: 'nope' is not available"):
        family_for("llama", "nope")


@pytest.mark.slow
def test_full_finetune_resumes_from_full_weights(write_config, tmp_path):
    config = write_config(
        {
            "training": {"method": "full", "max_steps": 4, "save_steps": 2},
            "optimization": {"learning_rate": 1e-3},
        }
    )
    first = run_trainer("train", "--config", str(config), "--set", "training.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "run" / "final-checkpoint-2" / "model.safetensors").is_file()
    second = run_trainer("train", "--config", str(config), "--extend")  # the 2-step run finished
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from" in second.stdout and (tmp_path / "run" / "final-checkpoint-4").is_dir()
