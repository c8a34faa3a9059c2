"""``python -m trainer info``: the JSON shape, versions, disk space, missing features, and the rule table."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shutil

import pytest
import torch
import yaml

from tests.helpers import REPO, TINY, deep_merge, run_trainer
from trainer.config import load_config
from trainer.tools import hardware


@pytest.fixture(scope="module")
def info_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("info")
    target = folder / "runs" / "not-created-yet"
    result = run_trainer("info", "--json", "--output-dir", str(target))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout), folder, target


def test_json_shape(info_json):
    info, _, _ = info_json
    assert set(info) == {
        "host",
        "python",
        "platform",
        "gpus",
        "gpu_unavailable_reasons",
        "cpu",
        "ram",
        "disk",
        "versions",
        "features",
        "recommendations",
        "cpu_only_advice",
    }
    assert info["cpu"]["logical_cores"] >= 1 and info["cpu"]["usable_cores"] >= 1
    assert info["ram"]["total_gib"] > 0 and 0 <= info["ram"]["available_gib"] <= info["ram"]["total_gib"]
    names = [f["name"] for f in info["features"]]
    assert {"gpu_training", "bf16_mixed_precision", "qlora_4bit", "bnb_8bit_and_paged_optimizers"} <= set(
        names
    )
    for feature in info["features"]:
        assert isinstance(feature["available"], bool)
        assert feature["available"] or feature["reason"], feature  # every missing feature says why


def test_versions_match_installed_packages(info_json):
    info, _, _ = info_json
    for name in hardware.PACKAGES + hardware.OPTIONAL_PACKAGES:
        try:
            expected = md.version(name)
        except md.PackageNotFoundError:
            expected = None
        assert info["versions"][name] == expected, name
    assert info["versions"]["torch"] == md.version("torch")


def test_disk_free_is_measured_where_the_run_folder_will_be(info_json):
    info, folder, target = info_json
    disk = info["disk"]
    assert disk["path"] == str(target)
    assert disk["measured_at"] == str(folder)  # nearest existing parent
    usage = shutil.disk_usage(folder)
    assert disk["total_bytes"] == usage.total
    assert abs(disk["free_bytes"] - usage.free) < 256 * 2**20  # other processes write meanwhile


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without a usable GPU")
def test_without_a_gpu_it_says_why_and_what_is_missing(info_json):
    info, _, _ = info_json
    assert not any(g["usable_by_torch"] for g in info["gpus"])
    reasons = " ".join(info["gpu_unavailable_reasons"])
    if torch.version.cuda is None:
        assert "CPU-only build" in reasons
    assert "NVML" in reasons or "nvidia-ml-py" in reasons or "driver" in reasons
    features = {f["name"]: f for f in info["features"]}
    assert not features["gpu_training"]["available"]
    assert not features["bnb_8bit_and_paged_optimizers"]["available"]
    assert "CUDA" in features["bnb_8bit_and_paged_optimizers"]["reason"]
    assert not features["fla_triton_kernels"]["available"]
    assert info["recommendations"] == [] and "tiny" in info["cpu_only_advice"]
    text = hardware.format_text(info)
    assert "gpu: none" in text and "  why: " in text and "[NO ] bnb_8bit_and_paged_optimizers" in text


def test_faked_gpus_get_recommendations_per_memory_size(monkeypatch, tmp_path):
    a100 = {
        "index": 0,
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_mb": 81038,
        "memory_gib": 79.1,
        "compute_capability": "8.0",
        "source": "torch",
        "usable_by_torch": True,
    }
    t4 = dict(
        a100, index=2, name="Tesla T4", memory_total_mb=15095, memory_gib=14.7, compute_capability="7.5"
    )
    monkeypatch.setattr(hardware, "detect_gpus", lambda: ([a100, dict(a100, index=1), t4], []))
    info = hardware.gather(tmp_path)
    assert info["cpu_only_advice"] is None and info["gpu_unavailable_reasons"] == []
    assert [(r["gpu"], r["memory_gib"]) for r in info["recommendations"]] == [
        ("NVIDIA A100-SXM4-80GB", 79.1),
        ("Tesla T4", 14.7),
    ]
    features = {f["name"]: f for f in info["features"]}
    assert features["gpu_training"]["available"] and features["multi_gpu"]["available"]
    assert not features["bf16_mixed_precision"]["available"]  # the T4 is compute 7.5
    t4_settings = info["recommendations"][1]["settings"]
    assert t4_settings[0]["mixed_precision"] == "fp16"
    assert "Tesla T4 (14.7 GiB)" in hardware.format_text(info)


@pytest.mark.parametrize(
    "gib, expected",
    [
        (79.1, [("lora", 4, 2048, False), ("lora", 2, 2048, True), ("qlora", 1, 2048, True)]),
        (47.5, [("lora", 4, 2048, True), ("qlora", 4, 2048, True), ("qlora", 1, 1024, True)]),
        (39.4, [("lora", 2, 2048, True), ("qlora", 2, 2048, True), None]),
        (23.6, [("qlora", 2, 2048, True), ("qlora", 1, 2048, True), None]),
        (22.0, [("qlora", 2, 2048, True), ("qlora", 1, 2048, True), None]),
        (21.9, [("qlora", 1, 2048, True), ("qlora", 1, 1024, True), None]),
        (11.6, [("qlora", 1, 1024, True), ("qlora", 1, 512, True), None]),
        (7.6, [("qlora", 1, 512, True), None, None]),
        (5.8, [None, None, None]),
    ],
)
def test_rule_table_for_faked_memory_sizes(gib, expected):
    got = hardware.recommend(gib)
    assert [s["model"] for s in got] == ["7B", "13B", "70B"]
    for setting, want in zip(got, expected):
        if want is None:
            assert setting["fits"] is False and "does not fit" in setting["advice"]
            continue
        assert setting["fits"] is True
        assert (
            setting["method"],
            setting["micro_batch_size"],
            setting["max_length"],
            setting["gradient_checkpointing"],
        ) == want
        assert setting["gradient_accumulation_steps"] == 16 // setting["micro_batch_size"]


def test_recommended_overrides_are_valid_config(tmp_path):
    ampere = hardware.recommend(23.6, "8.6")[0]
    assert ampere["mixed_precision"] == "bf16"
    assert "quantization.compute_dtype=bf16" in ampere["overrides"]
    turing = hardware.recommend(23.6, "7.5")[0]
    assert turing["mixed_precision"] == "fp16" and "quantization.compute_dtype=fp16" in turing["overrides"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(deep_merge(TINY, {"paths": {"output_dir": str(tmp_path / "r")}})))
    for setting in (ampere, turing, hardware.recommend(80)[0]):
        cfg = load_config(path, setting["overrides"])
        assert cfg.training.method == setting["method"]
        assert cfg.training.micro_batch_size == setting["micro_batch_size"]
        assert cfg.data.max_length == setting["max_length"]
        assert cfg.memory.gradient_checkpointing is setting["gradient_checkpointing"]


def test_documented_table_is_the_code_table():
    text = (REPO / "docs" / "operations.md").read_text()
    rows = re.findall(r"^\| (\d+B) \| ([\d.]+) \| (\w+) \| (\d+) \| (\d+) \| (on|off) \|$", text, re.M)
    documented = [(m, float(g), meth, int(mb), int(ml), gc == "on") for m, g, meth, mb, ml, gc in rows]
    assert documented == [
        (r.model, r.min_gib, r.method, r.micro_batch_size, r.max_length, r.gradient_checkpointing)
        for r in hardware.RULES
    ]
