"""The devices tab, ``/api/gpu`` and the GPU part of ``/metrics``: telemetry per device.

Why a module of its own: devices are keyed by host and index and sampled in wall time, not by
training step, so their series are cut by ``since_ts`` rather than ``since_step``.
"""

from __future__ import annotations

import math

import numpy as np

from trainer.runfolder.rundata import RunData
from trainer.runfolder.series import downsample_indices


def gpu(
    run: RunData, fields: list[str] | None, since_ts: float | None, max_points: int, with_series: bool
) -> dict:
    """The latest sample per device, and (optionally) each device's series ``[[ts, value], ...]``."""
    with run.lock:
        devices = [{"key": key, **record} for key, record in sorted(run.gpu.latest.items())]
        result = {"run": run.name, "devices": devices}
        if with_series:
            result["series"] = {
                key: _device_series(cols, fields, since_ts, max_points)
                for key, cols in sorted(run.gpu.series.items())
            }
        return result


def gpu_csv(result: dict) -> str:
    """``device,field,wall_time,value`` rows of every device's series."""
    lines = ["device,field,wall_time,value"]
    for device, fields in result.get("series", {}).items():
        for name, data in fields.items():
            for wall, value in data["points"]:
                lines.append(f"{device},{name},{wall},{'' if value is None else value}")
    return "\n".join(lines) + "\n"


def _device_series(cols, fields: list[str] | None, since_ts: float | None, max_points: int) -> dict:
    ts_col = cols.columns.get("ts")
    if ts_col is None:
        return {}
    ts = np.frombuffer(ts_col, dtype=float).copy()
    start = int(np.searchsorted(ts, since_ts, side="right")) if since_ts is not None else 0
    ts = ts[start:]
    names = fields if fields is not None else [n for n in cols.columns if n != "ts"]
    out = {}
    for name in names:
        column = cols.columns.get(name)
        if column is None:
            continue
        values = np.frombuffer(column, dtype=float)[start:].copy()
        keep = downsample_indices(values, max_points)
        out[name] = {
            "points": [
                [t, v if math.isfinite(v) else None] for t, v in zip(ts[keep].tolist(), values[keep].tolist())
            ],
            "total": len(values),
            "dropped": len(values) - len(keep),
        }
    return out
