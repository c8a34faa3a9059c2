"""Background hardware sampler: NVML on GPUs, psutil for CPU and RAM, one writer per node.

It runs in a daemon thread with its own log handle, so a slow sample never delays a training step.
"""

from __future__ import annotations

import socket
import threading

import psutil

from trainer.runlog import GPU_LOG, RunLog


def _nvml_handles():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no driver, no GPU, or no nvidia-ml-py: fall back to CPU samples
        return None, []


def gpu_samples(pynvml, handles) -> list[dict]:
    samples = []
    for index, handle in enumerate(handles):
        record = {"device": f"cuda:{index}"}
        for key, read in (
            ("name", lambda h: pynvml.nvmlDeviceGetName(h)),
            ("util_pct", lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
            ("mem_used_mb", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20),
            ("mem_total_mb", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**20),
            ("temp_c", lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
            ("power_w", lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
        ):
            try:
                value = read(handle)
                record[key] = (
                    value.decode()
                    if isinstance(value, bytes)
                    else round(value, 1)
                    if isinstance(value, float)
                    else value
                )
            except Exception:  # noqa: BLE001 - a field this GPU does not report
                continue
        samples.append(record)
    return samples


def cpu_sample() -> dict:
    memory = psutil.virtual_memory()
    return {
        "device": "cpu",
        "name": f"{psutil.cpu_count()} CPUs",
        "cpu_pct": psutil.cpu_percent(interval=None),
        "ram_used_mb": round((memory.total - memory.available) / 2**20, 1),
        "ram_total_mb": round(memory.total / 2**20, 1),
    }


class TelemetrySampler:
    """Writes one record per device (and one for the CPU) every ``interval`` seconds."""

    def __init__(self, output_dir, interval: float, enabled: bool = True):
        self.interval = interval
        self.enabled = enabled
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RunLog(output_dir, enabled=enabled)

    def sample_once(self) -> None:
        pynvml, handles = self._nvml
        for record in [*gpu_samples(pynvml, handles), cpu_sample()]:
            self._log.write(GPU_LOG, {"host": self.host, **record})

    def start(self) -> None:
        if not self.enabled:
            return
        self._nvml = _nvml_handles()
        psutil.cpu_percent(interval=None)  # prime the counter so the first sample is meaningful
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - telemetry must never take a run down
                pass
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._log.close()
