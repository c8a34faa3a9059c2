"""The CPU telemetry record carries the training process's own memory, not only the node's RAM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

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
