"""Series arithmetic shared by the API and the plots: downsampling and smoothing.

Downsampling keeps the first and last points and, in between, the lowest and highest point of
each bucket, so a loss spike survives on a thousand-point plot of a million steps (TensorBoard's
random sampling can drop it). Smoothing follows TensorBoard: a bias-corrected exponential moving
average where non-finite points pass through unsmoothed and do not disturb the average.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SMOOTHING_MODES = ("ema", "ma", "off")
DEFAULT_EMA_WEIGHT = 0.6
DEFAULT_MA_WINDOW = 10


def downsample_indices(values: np.ndarray, max_points: int) -> np.ndarray:
    """Indices to keep: all when few enough, else first, last, and each bucket's min and max.

    Non-finite points are never a bucket's pick unless the whole bucket is non-finite.
    """
    n = len(values)
    if max_points <= 0 or n <= max_points:
        return np.arange(n)
    inner = n - 2
    size = math.ceil(inner / max(1, (max_points - 2) // 2))
    buckets = math.ceil(inner / size)
    # Pad the last bucket with a copy of its last value: ties pick the first (real) position.
    grid = np.empty(buckets * size)
    grid[:inner] = values[1:-1]
    grid[inner:] = values[-2]
    grid = grid.reshape(buckets, size)
    if np.isfinite(grid).all():
        low, high = grid.argmin(axis=1), grid.argmax(axis=1)
    else:
        finite = np.isfinite(grid)
        low = np.where(finite, grid, np.inf).argmin(axis=1)
        high = np.where(finite, grid, -np.inf).argmax(axis=1)
    offsets = np.arange(buckets) * size + 1
    return np.unique(np.concatenate(([0], offsets + low, offsets + high, [n - 1])))


def ema_reference(values: Sequence[float], weight: float = DEFAULT_EMA_WEIGHT) -> list[float]:
    """TensorBoard's smoothing, point by point (``ema`` computes the same thing faster)."""
    out = []
    last = 0.0
    count = 0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out.append(last / (1.0 - weight**count))
    return out


def ema(values: Sequence[float], weight: float = DEFAULT_EMA_WEIGHT) -> np.ndarray:
    """TensorBoard's smoothing: bias-corrected EMA; non-finite points pass through and are skipped.

    Vectorized in blocks: inside a block, y_i = w^(i+1) y_prev + (1-w) sum_j w^(i-j) x_j, a
    cumulative sum of x_j w^-j; blocks are short enough that w^-j stays far from overflow.
    Works through the series a slice at a time, so a million points need little extra memory.
    Several times faster than the loop (``ema_reference``), equal to it within rounding.
    """
    array = np.asarray(values, dtype=float)
    finite = np.isfinite(array)
    x = array if finite.all() else array[finite]
    if weight <= 0 or len(x) == 0:
        return array.copy()
    block = max(1, min(1024, int(250 / -math.log10(weight))))
    powers = weight ** np.arange(block + 1)
    y = np.empty(len(x))
    previous = 0.0
    for start in range(0, len(x), block * 64):
        chunk = x[start : start + block * 64]
        rows = -(-len(chunk) // block)
        grid = np.zeros(rows * block)
        grid[: len(chunk)] = chunk
        # Each block as if it started from zero, then carry the previous block's last value in.
        partial = np.cumsum(grid.reshape(rows, block) / powers[:block], axis=1)
        partial *= powers[:block] * (1 - weight)
        carried = np.empty(rows)
        for k, last in enumerate(partial[:, -1].tolist()):
            carried[k] = previous
            previous = last + previous * powers[block]
        partial += carried[:, None] * powers[1:]
        y[start : start + len(chunk)] = partial.ravel()[: len(chunk)]
    # Bias correction 1 - w^k; w^k is below double precision after a few dozen points.
    head = min(len(x), int(40 / -math.log10(weight)) + 1)
    y[:head] /= 1.0 - weight ** np.arange(1, head + 1)
    if x is array:
        return y
    out = array.copy()
    out[finite] = y
    return out


def last_ema(values: Sequence[float], weight: float = DEFAULT_EMA_WEIGHT, tail: int = 400) -> float | None:
    """The smoothed value at the end of a series, from its last ``tail`` finite points.

    Older points weigh at most ``weight ** tail`` (1e-89 at 0.6), so this equals the full
    computation while costing the same on a million points as on a hundred.
    """
    finite = []
    for value in reversed(values):
        if math.isfinite(value):
            finite.append(value)
            if len(finite) >= tail:
                break
    if not finite:
        return None
    return float(ema(finite[::-1], weight)[-1])


def moving_average(values: Sequence[float], window: int = DEFAULT_MA_WINDOW) -> np.ndarray:
    """Trailing mean over the last ``window`` finite points; non-finite points pass through."""
    array = np.asarray(values, dtype=float)
    finite = np.isfinite(array)
    x = array if finite.all() else array[finite]
    sums = np.cumsum(x)
    y = np.empty(len(x))
    head = min(window, len(x))
    y[:head] = sums[:head] / np.arange(1, head + 1)
    y[head:] = sums[head:] - sums[:-head] if head else 0.0
    y[head:] /= window
    if x is array:
        return y
    out = array.copy()
    out[finite] = y
    return out


def smooth(values: Sequence[float], mode: str, weight: float, window: int) -> np.ndarray | None:
    """The smoothed line for a plot, or None when smoothing is off."""
    if mode == "ema":
        return ema(values, weight)
    if mode == "ma":
        return moving_average(values, window)
    return None
