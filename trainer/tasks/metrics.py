"""GLUE's official metrics in plain Python.

scikit-learn and scipy are test-only dependencies, so the training install cannot use them;
the tests check every function here against them on fixed vectors. A correlation with a
constant input (where scipy gives NaN) is 0.0: a model that always answers the same has no
correlation, and picking the best checkpoint by it stays well-defined. A correlation over a
non-finite value (NaN, inf) is NaN, "undefined": never clamped into [-1, 1], where a NaN
would have read as a perfect 1.0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence


def _check_lengths(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"metric inputs differ in length: {len(a)} vs {len(b)}")


def accuracy(golds: Sequence[Hashable], preds: Sequence[Hashable]) -> float:
    """Fraction of exact matches (0.0 for no examples)."""
    _check_lengths(golds, preds)
    if not golds:
        return 0.0
    return sum(g == p for g, p in zip(golds, preds)) / len(golds)


def f1_binary(golds: Sequence[Hashable], preds: Sequence[Hashable], positive: Hashable = 1) -> float:
    """F1 of the positive class, as ``sklearn.metrics.f1_score`` (0.0 when there is nothing to score)."""
    _check_lengths(golds, preds)
    tp = sum(g == positive and p == positive for g, p in zip(golds, preds))
    fp = sum(g != positive and p == positive for g, p in zip(golds, preds))
    fn = sum(g == positive and p != positive for g, p in zip(golds, preds))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_corrcoef(golds: Sequence[Hashable], preds: Sequence[Hashable]) -> float:
    """Matthews correlation, multiclass form (Gorodkin's R_K), as scikit-learn computes it."""
    _check_lengths(golds, preds)
    n = len(golds)
    correct = sum(g == p for g, p in zip(golds, preds))
    true_counts = Counter(golds)
    pred_counts = Counter(preds)
    classes = set(true_counts) | set(pred_counts)
    cov_tp = correct * n - sum(true_counts[c] * pred_counts[c] for c in classes)
    cov_pp = n * n - sum(pred_counts[c] ** 2 for c in classes)
    cov_tt = n * n - sum(true_counts[c] ** 2 for c in classes)
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return cov_tp / math.sqrt(cov_tt * cov_pp)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r; 0.0 when either side is constant (scipy: NaN); NaN when a value is not finite."""
    _check_lengths(xs, ys)
    if not all(math.isfinite(v) for v in (*xs, *ys)):
        return math.nan
    n = len(xs)
    if n < 2:
        return 0.0
    mean_x = math.fsum(xs) / n
    mean_y = math.fsum(ys) / n
    dx = [x - mean_x for x in xs]
    dy = [y - mean_y for y in ys]
    sxx = math.fsum(d * d for d in dx)
    syy = math.fsum(d * d for d in dy)
    if sxx == 0 or syy == 0:
        return 0.0
    if not math.isfinite(sxx * syy):  # squares overflowed (values beyond ~1e77): no answer, not a guess
        return math.nan
    r = math.fsum(a * b for a, b in zip(dx, dy)) / math.sqrt(sxx * syy)
    return max(-1.0, min(1.0, r))  # only rounding can take a finite r past +-1


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank (``scipy.stats.rankdata`` default)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        shared = (start + end) / 2 + 1
        for k in range(start, end + 1):
            ranks[order[k]] = shared
        start = end + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rho: Pearson's r of the average ranks, so ties count as scipy counts them."""
    _check_lengths(xs, ys)
    if not all(math.isfinite(v) for v in (*xs, *ys)):
        return math.nan  # NaN has no rank
    return pearson(average_ranks(xs), average_ranks(ys))
