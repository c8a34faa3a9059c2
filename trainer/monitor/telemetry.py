"""Background hardware sampler: NVML on GPUs, psutil for CPU and RAM, one writer per node.

It runs in a daemon thread with its own log handle, so a slow sample never delays a training step.
``open_nvml`` is the kit's one way into NVML (``trainer.tools.hardware`` lists GPUs through it too).
"""

from __future__ import annotations

import socket
import threading

import psutil

from trainer.runfolder import GPU_LOG, RunLog


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why (no nvidia-ml-py, no driver, no listing)."""


def open_nvml():
    """``(pynvml, device handles)`` after ``nvmlInit``; call ``close_nvml(pynvml)`` when done."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("nvidia-ml-py is not installed (no NVML: GPU telemetry off)") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - every NVML failure means the same thing here
        raise NvmlUnavailable(f"no NVIDIA driver found (NVML: {exc})") from exc
    try:
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:  # noqa: BLE001
        close_nvml(pynvml)
        raise NvmlUnavailable(f"NVML could not list the GPUs ({exc})") from exc


def close_nvml(pynvml) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - shutting down a half-initialised NVML may fail; nothing to do
        pass


def text(value) -> str:
    """NVML returns bytes from older nvidia-ml-py versions, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else value


def _nvml_handles():
    try:
        return open_nvml()
    except NvmlUnavailable:  # no driver, no GPU, or no nvidia-ml-py: fall back to CPU samples
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


def process_rss_mb(process: psutil.Process) -> tuple[float | None, float]:
    """Resident memory (MiB) of ``process`` and the sum over its live children (data-loader workers).

    Why: on a CPU machine ``ram_used_mb`` is the whole node's RAM, other jobs included; the run's own
    footprint is its process tree. Children that exit while being read are skipped; pages shared
    between processes are counted once per process (RSS), so the sum can overstate.
    """
    try:
        own = process.memory_info().rss / 2**20
    except psutil.Error:
        return None, 0.0
    children = 0.0
    try:
        kids = process.children(recursive=True)
    except psutil.Error:
        kids = []
    for child in kids:
        try:
            children += child.memory_info().rss / 2**20
        except psutil.Error:  # exited or not ours to read
            continue
    return round(own, 1), round(children, 1)


def cpu_sample(process: psutil.Process | None = None) -> dict:
    """The node's CPU busy share and RAM, and the training process's own resident memory."""
    memory = psutil.virtual_memory()
    record = {
        "device": "cpu",
        "name": f"{psutil.cpu_count()} CPUs",
        "cpu_pct": psutil.cpu_percent(interval=None),
        "ram_used_mb": round((memory.total - memory.available) / 2**20, 1),
        "ram_total_mb": round(memory.total / 2**20, 1),
    }
    own, children = process_rss_mb(process or psutil.Process())
    if own is not None:
        record["proc_rss_mb"] = own
        record["children_rss_mb"] = children
    return record


class TelemetrySampler:
    """Writes one record per device (and one for the CPU) every ``interval`` seconds."""

    def __init__(self, output_dir, interval: float, enabled: bool = True):
        self.interval = interval
        self.enabled = enabled
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RunLog(output_dir, enabled=enabled)
        self._process = psutil.Process()  # the training process: the sampler thread runs inside it

    def sample_once(self) -> None:
        pynvml, handles = self._nvml
        for record in [*gpu_samples(pynvml, handles), cpu_sample(self._process)]:
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
