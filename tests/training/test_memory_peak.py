"""bench/memory_peak.py: what is live at a run's peak device memory, from an allocator snapshot's history."""

import pickle

from bench import memory_peak

MIB = 2**20
TORCH = "/usr/lib/python3/site-packages/torch/nn/functional.py"


def frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


WEIGHTS = frames((TORCH, 1, "linear"), ("/repo/trainer/model/loading.py", 40, "load"))
LOSS = frames(
    ("/x/site-packages/liger_kernel/ops/flce.py", 90, "forward"),
    ("/repo/trainer/training/step.py", 12, "loss"),
)
CAPTURED = frames(
    (TORCH, 5, "silu"),
    ("/repo/trainer/fastpath/layer_graphs.py", 66, "capture"),
    ("/repo/trainer/fastpath/layer_graphs.py", 250, "backward"),
)


OFFLOAD = frames(("/repo/trainer/fastpath/offload.py", 40, "__init__"))


def alloc(addr, mib, where):
    return [{"action": "alloc", "addr": addr, "size": mib * MIB, "frames": where}]


def requested(addr, mib):
    return [{"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}]


def completed(addr, mib):
    return [{"action": "free_completed", "addr": addr, "size": mib * MIB, "frames": []}]


def free(addr, mib):
    return requested(addr, mib) + completed(addr, mib)


def snapshot():
    """Weights (100), a capture whose transient 60 MiB stays in the pool, a 10 MiB block whose free waits on
    another stream until after the first loss (30 MiB), then a second loss. The allocator's peak is the
    capture's (160); from the capture on, 140 MiB are occupied at once (the deferred block counted), plus the
    pool's 64 MiB left unallocated."""
    events = [
        *alloc(1, 100, WEIGHTS),
        *alloc(2, 60, CAPTURED),
        *free(2, 60),
        *alloc(7, 10, OFFLOAD),
        *requested(7, 10),
        *alloc(3, 30, LOSS),
        *free(3, 30),
        *completed(7, 10),
        *alloc(4, 30, LOSS),
        *free(4, 30),
    ]
    segments = [
        {"device": 0, "total_size": 128 * MIB, "allocated_size": 100 * MIB, "segment_pool_id": (0, 0)},
        {"device": 0, "total_size": 64 * MIB, "allocated_size": 0, "segment_pool_id": (1, 2)},
    ]
    return {"device_traces": [events], "segments": segments}


def test_the_peak_after_capture_counts_the_pools_unallocated_bytes_and_names_what_was_live():
    peak = memory_peak.analyse(snapshot())
    assert peak.allocated_peak == 160 * MIB and peak.occupied_peak == 160 * MIB and peak.before_history == 0
    assert (peak.pool_reserved, peak.pool_allocated) == (64 * MIB, 0)
    assert peak.after_capture_bytes == 140 * MIB and peak.after_capture == 6
    assert peak.live == {
        ("trainer/model/loading.py:40 load", "trainer/model/loading.py:40 load"): [100 * MIB, 1],
        ("liger_kernel/ops/flce.py:90 forward", "trainer/training/step.py:12 loss"): [30 * MIB, 1],
        ("trainer/fastpath/offload.py:40 __init__", "trainer/fastpath/offload.py:40 __init__"): [10 * MIB, 1],
    }
    assert peak.captured_peak == 60 * MIB  # the capture's transient: what sizes the pool
    assert peak.captured_live == {
        ("trainer/fastpath/layer_graphs.py:66 capture", "trainer/fastpath/layer_graphs.py:66 capture"): [
            60 * MIB,
            1,
        ]
    }
    text = memory_peak.report(peak, top=1)
    assert "= 204 MiB" in text and "| 100.0 | 1 | trainer/model/loading.py:40 load |" in text
    assert "| 40.0 | 2 | 2 other sites | |" in text
    assert (
        "inside the captured calls, at most: 60 MiB" in text
        and "| 60.0 | 1 | trainer/fastpath/layer_graphs.py:66 capture |" in text
    )


def test_the_loss_computed_in_the_pools_free_memory_is_counted_once_with_the_pool():
    """After capture the loss borrows the pool's free memory (``CudaGraphs.run_in_free_memory``) and copies its
    results out: the borrowed block lies inside the pool's segment and is the pool's unallocated bytes, already
    counted; only the copy comes on top."""
    snap = snapshot()
    pool = 1000 * MIB
    snap["segments"][1]["address"] = pool
    lent = frames(
        ("/x/site-packages/liger_kernel/ops/cross_entropy.py", 9, "forward"),
        ("/repo/trainer/fastpath/layer_graphs.py", 95, "run_in_free_memory"),
    )
    snap["device_traces"][0] += [*alloc(pool + MIB, 70, lent), *alloc(9, 5, LOSS), *free(pool + MIB, 70)]
    peak = memory_peak.analyse(snap)
    # counted beside the pool it would make the peak 100 + 70 + 5 = 175 MiB; the peak stays the first loss's
    assert peak.after_capture_bytes == 140 * MIB and peak.after_capture == 6
    assert (
        "liger_kernel/ops/cross_entropy.py:9 forward",
        "trainer/fastpath/layer_graphs.py:95 run_in_free_memory",
    ) not in peak.live
    assert peak.allocated_peak == 175 * MIB  # the allocator counts it, as max_memory_allocated does


def test_a_block_whose_free_waits_on_another_stream_is_occupied_though_no_longer_allocated():
    snap = snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][4:]  # from the deferred block on: no capture
    snap["segments"] = []
    peak = memory_peak.analyse(snap)
    assert peak.allocated_peak == 30 * MIB and peak.occupied_peak == 40 * MIB


def test_memory_the_history_never_saw_allocated_is_counted_as_there_from_the_start():
    snap = snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][1:]  # the ring buffer lost the weights' allocation
    peak = memory_peak.analyse(snap)
    assert peak.before_history == 100 * MIB and peak.after_capture_bytes == 140 * MIB


def test_the_command_reads_pickles_and_refuses_a_file_without_history(tmp_path, capsys):
    good, bad = tmp_path / "1.pickle", tmp_path / "2.pickle"
    good.write_bytes(pickle.dumps(snapshot()))
    bad.write_bytes(pickle.dumps({"segments": []}))
    assert memory_peak.main([str(good), "--top", "5"]) == 0
    assert "occupied outside the pools" in capsys.readouterr().out
    assert memory_peak.main([str(bad)]) == 2
    assert "2.pickle: no history for device 0" in capsys.readouterr().err
