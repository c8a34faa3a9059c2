"""The CPU telemetry record carries the training process's own memory, not only the node's RAM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from trainer.monitor.telemetry import TelemetrySampler, cpu_sample
from trainer.runfolder import GPU_LOG, LOGS_DIR


def test_cpu_record_has_the_process_rss_and_its_childrens(tmp_path: Path):
    # A child holding ~64 MiB resident, so its share is visible in children_rss_mb.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; b = bytearray(64 << 20); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()
        sampler = TelemetrySampler(tmp_path, interval=60)
        sampler._nvml = (None, [])
        sampler.sample_once()
        sampler.stop()
        child_rss = psutil.Process(child.pid).memory_info().rss / 2**20
    finally:
        child.kill()
        child.wait()
    records = [json.loads(line) for line in (tmp_path / LOGS_DIR / GPU_LOG).read_text().splitlines()]
    (cpu,) = [r for r in records if r["device"] == "cpu"]
    own = psutil.Process().memory_info().rss / 2**20
    assert abs(cpu["proc_rss_mb"] - own) < 0.25 * own  # this process, not the machine's RAM in use
    assert cpu["proc_rss_mb"] < cpu["ram_used_mb"] <= cpu["ram_total_mb"]
    assert cpu["children_rss_mb"] >= 0.9 * child_rss >= 60


def test_a_gone_process_leaves_the_machine_fields(tmp_path: Path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(child.pid)
    child.wait()
    record = cpu_sample(process)
    assert "proc_rss_mb" not in record and record["ram_total_mb"] > 0


class FakeNvml:
    """NVML on a host of four GPUs, numbered by bus as NVML numbers them; each reports its own memory in use."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, count: int = 4):
        self.uuids = [f"GPU-{i}a{i}b{i}c{i}-0000-1111-2222-33334444555{i}" for i in range(count)]

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle]

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"used": (handle + 1) * 2**30, "total": 80 * 2**30})()

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": 10 * handle})()

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 40 + handle

    def nvmlDeviceGetPowerUsage(self, handle):
        return 100_000 + handle


def _sampled(tmp_path: Path, monkeypatch, variable: str | None, torch_uuids=None) -> list[dict]:
    """The GPU records one sample writes on the fake four-GPU host with this CUDA_VISIBLE_DEVICES."""
    from trainer.monitor import telemetry

    nvml = FakeNvml()
    if variable is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", variable)
    monkeypatch.setattr(telemetry, "_nvml_handles", lambda: (nvml, [0, 1, 2, 3]))
    monkeypatch.setattr(telemetry, "torch_visible_uuids", lambda: torch_uuids)
    folder = tmp_path / (variable or "unset").replace(",", "_")
    sampler = TelemetrySampler(folder, interval=3600)
    sampler.start()  # samples once at once, then waits an hour
    sampler.stop()
    records = [json.loads(line) for line in (folder / LOGS_DIR / GPU_LOG).read_text().splitlines()]
    return [r for r in records if r["device"] != "cpu"]


def test_a_run_on_one_gpu_of_four_logs_only_its_own_as_cuda_0(tmp_path, monkeypatch):
    """CUDA_VISIBLE_DEVICES=2 on a four-GPU host: one GPU record, cuda:0, read from NVML's GPU 2."""
    (gpu,) = _sampled(tmp_path, monkeypatch, "2")
    assert gpu["device"] == "cuda:0" and gpu["nvml_index"] == 2
    assert gpu["mem_used_mb"] == 3 * 1024 and gpu["temp_c"] == 42  # GPU 2's own numbers


@pytest.mark.parametrize(
    "variable, expected",
    [
        (None, [0, 1, 2, 3]),  # unset: the whole host is the process's
        ("0", [0]),
        ("3,1", [3, 1]),  # the process's order, not NVML's
        ("GPU-2a2b2c2", [2]),  # a UUID prefix, as CUDA takes it
        ("1,7,2", [1]),  # CUDA stops at the first entry that names no GPU
        ("", []),
        ("-1", []),
    ],
)
def test_visible_devices_are_labelled_as_the_process_sees_them(tmp_path, monkeypatch, variable, expected):
    gpus = _sampled(tmp_path, monkeypatch, variable)
    assert [g["nvml_index"] for g in gpus] == expected
    assert [g["device"] for g in gpus] == [f"cuda:{i}" for i in range(len(expected))]


def test_torch_uuids_decide_over_the_variable(tmp_path, monkeypatch):
    """Where torch runs, its UUIDs (bare, in its order) settle the mapping, whatever CUDA_DEVICE_ORDER did
    to the indices in CUDA_VISIBLE_DEVICES."""
    nvml = FakeNvml()
    torch_uuids = [nvml.uuids[3].removeprefix("GPU-"), nvml.uuids[0].removeprefix("GPU-")]
    gpus = _sampled(tmp_path, monkeypatch, "0,1", torch_uuids=torch_uuids)
    assert [(g["device"], g["nvml_index"]) for g in gpus] == [("cuda:0", 3), ("cuda:1", 0)]
