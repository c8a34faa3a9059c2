"""Background hardware sampler: NVML on GPUs, psutil for CPU and RAM, one writer per node.

It runs in a daemon thread with its own log handle, so a slow sample never delays a training step. It samples
the GPUs the process sees (``CUDA_VISIBLE_DEVICES``), matched to NVML by UUID and named as the process names
them (``cuda:0`` first), never the rest of the host (``visible_devices``).
``open_nvml`` is the kit's one way into NVML (``trainer.tools.hardware`` lists GPUs through it too).
"""

from __future__ import annotations

import os
import socket
import sys
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


def _uuid(value) -> str:
    """A GPU's UUID without NVML's ``GPU-`` prefix (torch reports it bare), lower case."""
    return str(text(value)).lower().removeprefix("gpu-")


def torch_visible_uuids() -> list[str] | None:
    """The UUIDs of the GPUs this process sees, in its own order (``cuda:0`` first), from torch; None where
    torch has not been imported or sees no GPU (then ``CUDA_VISIBLE_DEVICES`` is read instead)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return [_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - an old torch without .uuid, a broken driver: fall back to the variable
        return None


def _visible_by_variable(uuids: list[str], variable: str | None) -> list[int] | None:
    """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` names, in its order (None: unset, all of them).

    As CUDA reads it: entries are indices or UUIDs (``GPU-`` and any unique prefix of one), separated by
    commas; the first entry that names no GPU ends the list (``-1`` or an empty value: none). Indices are
    taken in NVML's (PCI bus) order, which is CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on hosts of
    one GPU model; torch's UUIDs, when torch runs, settle it exactly."""
    if variable is None:
        return None
    chosen: list[int] = []
    for entry in (part.strip() for part in variable.split(",")):
        if entry.isdigit():
            index = int(entry)
            if index >= len(uuids):
                break
        else:
            prefix = _uuid(entry)
            matches = [i for i, uuid in enumerate(uuids) if prefix and uuid.startswith(prefix)]
            if len(matches) != 1:  # MIG-..., a typo or an ambiguous prefix: CUDA stops here too
                break
            index = matches[0]
        if index in chosen:
            break
        chosen.append(index)
    return chosen


def visible_devices(pynvml, handles, cuda_uuids: list[str] | None = None, environ=None) -> list[tuple]:
    """``(label, NVML index, handle)`` of each GPU this process sees, labelled as it sees it: ``cuda:0`` is
    its first GPU. NVML numbers every GPU of the host by bus; a run started with ``CUDA_VISIBLE_DEVICES=2``
    trains on NVML's GPU 2, which it calls ``cuda:0``, and the host's other GPUs are not its own. Matched by
    UUID: ``cuda_uuids`` (torch's, in the process's order), else ``CUDA_VISIBLE_DEVICES`` from ``environ``."""
    uuids = []
    for handle in handles:
        try:
            uuids.append(_uuid(pynvml.nvmlDeviceGetUUID(handle)))
        except Exception:  # noqa: BLE001 - no UUID: only an unset CUDA_VISIBLE_DEVICES can place it
            uuids.append("")
    if cuda_uuids is not None:
        order = [uuids.index(u) for u in (_uuid(u) for u in cuda_uuids) if u and u in uuids]
    else:
        environ = os.environ if environ is None else environ
        order = _visible_by_variable(uuids, environ.get("CUDA_VISIBLE_DEVICES"))
        if order is None:
            order = list(range(len(handles)))
    return [(f"cuda:{label}", index, handles[index]) for label, index in enumerate(order)]


def gpu_samples(pynvml, visible: list[tuple]) -> list[dict]:
    """One record per GPU of this process, ``visible``: ``visible_devices``' answer."""
    samples = []
    for label, nvml_index, handle in visible:
        record = {"device": label, "nvml_index": nvml_index}
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
        self._nvml = (None, [])
        self._visible: list[tuple] = []  # (label, NVML index, handle) of the GPUs this process sees

    def sample_once(self) -> None:
        pynvml, _ = self._nvml
        for record in [*gpu_samples(pynvml, self._visible), cpu_sample(self._process)]:
            self._log.write(GPU_LOG, {"host": self.host, **record})

    def start(self) -> None:
        if not self.enabled:
            return
        self._nvml = _nvml_handles()
        self._visible = (
            visible_devices(*self._nvml, cuda_uuids=torch_visible_uuids()) if self._nvml[1] else []
        )
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
