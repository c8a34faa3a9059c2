"""bench/trace_gaps.py: the device's idle gaps in a profiler trace, charged to the host op that opened them."""

import json

import pytest

from bench import trace_gaps


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def _trace():
    return {
        "traceEvents": [
            _x("ProfilerStep#1", "user_annotation", 0, 1000),
            _x("forward", "cpu_op", 0, 400),
            _x("aten::mm", "cpu_op", 10, 40),
            _x("LigerFusedLinearCrossEntropyFunction", "cpu_op", 400, 500),
            _x("aten::item", "cpu_op", 400, 200),
            _x("MmBackward0", "cpu_op", 600, 100, tid=2),  # autograd's thread
            _x("cudaLaunchKernel", "cuda_runtime", 15, 3),
            _x("cudaMemcpyAsync", "cuda_runtime", 30, 3),
            _x("cudaStreamSynchronize", "cuda_runtime", 410, 180),
            _x("gemm", "kernel", 20, 280, tid=9),
            _x("gemm", "kernel", 300, 50, tid=9),  # touches the first: one busy span
            _x("ce", "kernel", 610, 80, tid=9),
            _x("memcpy", "gpu_memcpy", 950, 50, tid=9),
            _x("tiny", "kernel", 1010, 10, tid=9),  # a 10 us gap: under the threshold
            _x("ncclDevKernel_AllGather_RING_LL", "kernel", 300, 200, tid=10),  # 50 us beside the gemm
        ]
    }


def test_idle_gaps_are_charged_to_the_host_op_that_was_running_when_the_device_ran_dry():
    report = trace_gaps.analyse(_trace(), min_gap_us=20)
    assert report["window_ms"] == pytest.approx(1.0)
    assert report["busy_ms"] == pytest.approx(0.47)
    assert report["idle_ms"] == pytest.approx(0.53)
    assert report["gaps"] == 2 and report["idle_in_gaps_ms"] == pytest.approx(0.52)
    assert report["collective_ms"] == pytest.approx(0.2) and report["collective_exposed_ms"] == pytest.approx(
        0.15
    )
    inner = {row["name"]: row["ms"] for row in report["by_inner"]}
    # at 350 us the main thread is inside forward (the loss starts at 400); at 690 us autograd's thread began
    # MmBackward0 more recently than the main thread's loss op, so the gap is backward's
    assert inner == {"forward": pytest.approx(0.26), "MmBackward0": pytest.approx(0.26)}
    outer = {row["name"]: row["ms"] for row in report["by_outer"]}
    assert outer == {"ProfilerStep#1": pytest.approx(0.26), "MmBackward0": pytest.approx(0.26)}
    assert [(r["name"], r["count"]) for r in report["blocking_calls"]] == [("cudaStreamSynchronize", 1)]
    assert report["largest"][0]["host"] in ("ProfilerStep#1 > forward", "MmBackward0")


def test_the_command_prints_per_step_figures_and_names_a_bad_trace(tmp_path, capsys):
    good = tmp_path / "rank0.trace.json"
    good.write_text(json.dumps(_trace()))
    out = tmp_path / "gaps.json"
    assert trace_gaps.main([str(good), "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "device busy 0.23 ms, idle 0.27 ms per step (over 2)" in printed
    assert "collectives 0.10 ms per step (over 2), 0.07 ms of it beside no compute kernel" in printed
    assert "MmBackward0" in printed and "cudaStreamSynchronize" in printed
    assert json.loads(out.read_text())[str(good)]["gaps"] == 2
    cpu_only = tmp_path / "cpu.trace.json"
    cpu_only.write_text(json.dumps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}))
    assert trace_gaps.main([str(cpu_only)]) == 2
    assert str(cpu_only) in capsys.readouterr().err
