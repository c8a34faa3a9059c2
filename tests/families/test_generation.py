"""Generation-based evaluation for every family: left-padded batches give the unpadded continuations,
and a task evaluation runs inside training for GLA, Mamba-2 and Mamba-1."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import REPO, run_trainer
from tests.tasks.test_task_eval import write_sst2
from trainer import runfolder
from trainer.config import load_config
from trainer.model.loading import load_for_training
from trainer.runfolder import iter_records
from trainer.training.generation import generate_texts

FAMILIES = {
    "gla": "configs/tiny-gla.yaml",
    "mamba2": "configs/tiny-mamba2.yaml",
    "mamba": "configs/tiny-mamba.yaml",
}
PROMPTS = ["Ada lives in", "The road from Marlow to Tessin is long and every morning the baker"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_batch_generates_like_single_prompts(family):
    cfg = load_config(REPO / FAMILIES[family], ["lora.dropout=0.0"])
    loaded = load_for_training(cfg, torch.device("cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)  # the adapter takes part in generation
    batched = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=2)
    single = [generate_texts(model, tokenizer, [p], max_new_tokens=6, batch_size=1)[0] for p in PROMPTS]
    assert batched == single and any(batched)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_task_evaluation_during_training(family, tmp_path):
    glue = write_sst2(tmp_path / "glue", rows=8)
    run = tmp_path / "run"
    result = run_trainer(
        "train", "--config", str(REPO / FAMILIES[family]),
        "--set", f"paths.output_dir={run}", "--set", "training.max_steps=2", "--set", "training.save_steps=100",
        "--set", "eval.task=sst2", "--set", f"eval.task_data_dir={glue}", "--set", "eval.max_new_tokens=3",
        "--set", "data.max_length=64", "--set", "logging.progress_bar=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = list(iter_records(run / "logs" / runfolder.EVAL_LOG))[-1]
    assert record["task"] == "sst2" and record["metrics"]["n"] == 8
    assert 0.0 <= record["metrics"]["accuracy"] <= 1.0
    assert all(isinstance(s["prediction"], str) for s in record["samples"])
