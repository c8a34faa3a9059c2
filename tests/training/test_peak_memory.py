"""The run's peak GPU memory with CUDA graphs (trainer/training/step_log.py, trainer/fastpath/layer_graphs.py).

No GPU here: the allocator's counters and snapshot are stood in for. What is checked is the arithmetic that
decides the figure the run folder and the benches report: a graph pool's unallocated bytes are added once,
from the record after the capture on, and its live tensors (counted by the allocator already) never.
"""

from __future__ import annotations

import torch

from trainer.fastpath import layer_graphs
from trainer.fastpath.layer_graphs import CudaGraphs
from trainer.training.step_log import PeakMemory

MB = 2**20


def test_only_a_pools_unallocated_bytes_count_as_unseen(monkeypatch):
    pool = (0, 7)
    segments = [
        {"segment_pool_id": pool, "total_size": 100 * MB, "allocated_size": 30 * MB},
        {"segment_pool_id": pool, "total_size": 20 * MB, "allocated_size": 20 * MB},
        {"segment_pool_id": (0, 0), "total_size": 500 * MB, "allocated_size": 1 * MB},  # another pool's
        {"total_size": 64 * MB, "allocated_size": 0},  # the default pool's
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert layer_graphs._unallocated_pool_bytes(pool) == 70 * MB


class FakeAllocator:
    """The allocator's peak since its last reset, as a test sets it."""

    def __init__(self, monkeypatch):
        self.peak = 0
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)


def test_a_captured_pools_transients_count_from_the_record_after_the_capture(monkeypatch):
    monkeypatch.setattr(CudaGraphs, "live", set())
    allocator = FakeAllocator(monkeypatch)
    peak = PeakMemory(torch.device("cuda", 0))

    allocator.peak = 1000 * MB  # an eager step: nothing hidden
    assert peak.read_mb() == 1000

    # the capture's interval: its transient tensors were allocated then, and the allocator's peak saw them
    graphs = CudaGraphs.__new__(CudaGraphs)
    graphs.unseen_bytes = 300 * MB
    CudaGraphs.live.add(graphs)
    allocator.peak = 1300 * MB
    assert peak.read_mb() == 1300

    # replays: the allocator no longer sees the transients, the pool still holds them
    allocator.peak = 1000 * MB
    assert peak.read_mb() == 1300
    assert peak.read_mb() == 1300


def test_a_run_that_starts_with_graphs_live_counts_them_from_its_first_record(monkeypatch):
    graphs = CudaGraphs.__new__(CudaGraphs)
    graphs.unseen_bytes = 50 * MB
    monkeypatch.setattr(CudaGraphs, "live", {graphs})
    allocator = FakeAllocator(monkeypatch)
    allocator.peak = 200 * MB
    assert PeakMemory(torch.device("cuda", 0)).read_mb() == 250


def test_on_cpu_the_figure_is_the_process_memory():
    import psutil

    rss = psutil.Process().memory_info().rss / MB
    assert abs(PeakMemory(torch.device("cpu")).read_mb() - rss) < 200


def test_the_cache_is_handed_back_once_before_the_first_capture(monkeypatch):
    """The eager step's freed activations sit in the allocator's cache, which the graphs' pool cannot use:
    ``CudaGraphs`` empties the cache before it makes its pool, once, and not between later captures."""
    import contextlib

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: calls.append("pool") or (0, 1))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    graphs = CudaGraphs()
    for _ in range(3):
        graphs.capture(lambda: calls.append("body"))
    assert calls == ["empty_cache", "pool", "body", "body", "body"]


def test_memory_lent_from_a_pool_is_counted_once(monkeypatch):
    """``run_in_free_memory`` (the loss in the layer graphs' pool): the allocator counts the lent blocks as
    allocated while the pool's unseen bytes count them already. The peak before the call is carried and the
    allocator's restarted after it, so the record holds the largest of both plus the pool, once."""
    calls = []
    for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(
            torch._C, name, lambda device, pool, name=name: calls.append((name, pool)), raising=False
        )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5000 * MB)
    monkeypatch.setattr(CudaGraphs, "live", set())
    monkeypatch.setattr(CudaGraphs, "carried_peak", 0)
    allocator = FakeAllocator(monkeypatch)
    allocator.current = 0
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda device=None: setattr(allocator, "peak", allocator.current),
    )
    graphs = CudaGraphs.__new__(CudaGraphs)
    graphs.pool, graphs.unseen_bytes = (0, 3), 300 * MB
    CudaGraphs.live.add(graphs)
    peak = PeakMemory(torch.device("cuda", 0))

    allocator.peak, allocator.current = 1200 * MB, 1000 * MB  # the forward's replays and the final norm

    def compute():
        assert calls == [("_cuda_beginAllocateCurrentThreadToPool", (0, 3))]  # allocations routed to the pool
        allocator.peak = 1450 * MB  # the loss's transients, in the pool's free memory
        allocator.current = 1032 * MB  # what stays once the lent blocks are freed: the copied-out gradient
        return (torch.ones(3),)

    (copy,) = graphs.run_in_free_memory(compute)
    assert torch.equal(copy, torch.ones(3))
    assert [name for name, _ in calls[1:]] == ["_cuda_endAllocateToPool", "_cuda_releasePool"]
    allocator.peak = 1100 * MB  # the backward's replays
    assert peak.read_mb() == 1200 + 300  # not 1450 + 300: the loss's blocks are the pool's
    allocator.peak = 1000 * MB
    assert peak.read_mb() == 1000 + 300  # the carried peak belonged to the last record only


def test_before_the_first_capture_nothing_is_lent(monkeypatch):
    graphs = CudaGraphs.__new__(CudaGraphs)
    graphs.pool = None
    made = torch.ones(2)
    (copy,) = graphs.run_in_free_memory(lambda: (made,))
    assert torch.equal(copy, made) and copy.data_ptr() != made.data_ptr()
