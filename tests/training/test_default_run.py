"""The shipped default run, end to end: every log file and field, checkpoints, retention, the summary."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import REPO
from trainer import runfolder
from trainer.runfolder import REQUIRED_FIELDS, iter_records

# Every test reads the shipped config's real run (the session's default_run).
pytestmark = pytest.mark.slow


def records(run, name):
    return list(iter_records(run / runfolder.LOGS_DIR / name))


def test_default_run_says_where_its_run_folder_is(default_run):
    # Its wall time (target: under 3 minutes on 2 cores) is measured by bench/bench_default_run.py, not here.
    out = default_run["stdout"]
    assert f"run folder: {default_run['path']}" in out
    assert "./launch_dashboard.sh --logdir" in out and "http://localhost:5000" in out


def test_every_log_has_its_documented_fields(default_run):
    run = default_run["path"]
    for name, fields in REQUIRED_FIELDS.items():
        recs = records(run, name)
        if name == runfolder.ERROR_LOG:
            assert recs == []  # a clean run has no errors
            continue
        assert recs, f"{name} is empty"
        for record in recs:
            missing = [f for f in fields if f not in record]
            assert not missing, f"{name} record lacks {missing}: {record}"
            assert isinstance(record["ts"], float)
    for line in (run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG).read_text().splitlines():
        json.loads(line)  # every line is standalone JSON


def test_training_log_is_complete_and_loss_falls(default_run):
    run = default_run["path"]
    train = records(run, runfolder.TRAINING_LOG)
    total = train[0]["total_steps"]
    assert [r["step"] for r in train] == list(range(1, total + 1))
    first = sum(r["loss"] for r in train[:10]) / 10
    last = sum(r["loss"] for r in train[-10:]) / 10
    assert last < first - 2.0, (first, last)
    assert all(r["tokens_per_sec"] > 0 and r["aux_loss"] > 0 for r in train)
    evals = records(run, runfolder.EVAL_LOG)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert math.isclose(evals[-1]["perplexity"], math.exp(evals[-1]["eval_loss"]), rel_tol=1e-6)


def test_expert_usage_counts_real_routing(default_run):
    run = default_run["path"]
    usage = records(run, runfolder.EXPERT_LOG)
    assert usage[0]["num_experts"] == 8 and usage[0]["top_k"] == 2
    for record in usage:
        assert len(record["layers"]) == 2
        for layer in record["layers"]:
            assert sum(layer["counts"]) == layer["tokens"] * 2
            assert math.isclose(sum(layer["fractions"]), 1.0, abs_tol=1e-4)
            assert layer["imbalance"] >= 1.0
            assert 0 < layer["entropy"] <= math.log(8) + 1e-9
    # Windows tile the run: each starts right after the previous one ends.
    for before, after in zip(usage, usage[1:]):
        assert after["start_step"] == before["step"] + 1


def test_run_json_and_events(default_run):
    run = default_run["path"]
    info = json.loads((run / runfolder.RUN_JSON).read_text())
    assert info["status"] == "finished" and info["ended_at"] >= info["started_at"]
    assert info["family"] == "causal" and info["model_type"] == "qwen2_moe" and info["world_size"] == 1
    assert info["versions"]["torch"] and info["versions"]["transformers"]
    events = [e["event"] for e in records(run, runfolder.EVENTS_LOG)]
    assert events[0] == "run_start" and events[-1] == "run_end"
    for needed in (
        "data_report",
        "model_report",
        "length_report",
        "checkpoint_saved",
        "checkpoint_pruned",
        "best_updated",
        "eval_start",
        "eval_done",
    ):
        assert needed in events
    gpu = records(run, runfolder.GPU_LOG)
    assert gpu and gpu[0]["device"] == "cpu" and gpu[0]["ram_total_mb"] > 0


def test_checkpoints_retained_and_loadable(default_run):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    run = default_run["path"]
    periodic = sorted(p.name for p in run.glob("checkpoint-*"))
    finals = sorted(p.name for p in run.glob("final-checkpoint-*"))
    assert len(periodic) <= 2 and finals == ["final-checkpoint-240"]
    saved = [e for e in records(run, runfolder.EVENTS_LOG) if e["event"] == "checkpoint_saved"]
    pruned = {e["path"] for e in records(run, runfolder.EVENTS_LOG) if e["event"] == "checkpoint_pruned"}
    for event in saved:
        assert (event["path"] in pruned) != (run / event["path"].split("/")[-1]).exists()
    best = run / runfolder.BEST_ADAPTER_DIR
    assert (best / "adapter_model.safetensors").is_file() and not (best / "training_state").exists()
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-moe"))
    model = PeftModel.from_pretrained(base, best)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    state = json.loads((run / finals[0] / "trainer_state.json").read_text())
    assert state["step"] == 240 and state["metric"] == "eval_loss" and state["processes"] == 1


def test_resolved_config_reproduces_the_run(default_run):
    from trainer.config import load_config

    run = default_run["path"]
    cfg = load_config(run / runfolder.CONFIG_YAML)
    assert cfg.paths.output_dir == str(run)
    assert cfg.training.max_steps == 240 and cfg.model.random_init is True


def test_end_of_run_report_and_length_report(default_run):
    run = default_run["path"]
    assert (run / "report" / "index.html").is_file()
    assert any((run / "report").glob("*.png"))
    assert f"report: {run / 'report' / 'index.html'}" in default_run["stdout"]
    assert "loss, steps 1-240" in default_run["stdout"]  # the ASCII curve
    data_report = json.loads((run / "data_report.json").read_text())
    assert data_report["max_length"] == 256 and data_report["lengths"]["count"] > 0
    assert "lengths (tokens): median" in default_run["stdout"]
