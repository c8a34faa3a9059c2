"""When the GPU waits, and on what: the idle gaps of a torch.profiler trace, each laid on the host op that was
running when it opened.

A kit run with ``performance.profile_from`` writes ``profile/rank<N>-steps<A>-<B>.trace.json``; the table beside
it sums device time, which says nothing about the time the device sat idle. This reads the timeline: the union
of kernels, copies and memsets (collectives apart: they spin while waiting for the other ranks) is the busy
time, everything else between the first and the last is idle, and
every gap of at least ``--min-gap-us`` is charged to the innermost host op (of any host thread: forward on the
main thread, backward on autograd's) that covered its start, and to that op's outermost caller. Host calls that
block on the device (synchronize, blocking copies) are counted apart: a gap right after one is the host
catching up.

    python bench/trace_gaps.py RUN/profile/rank0-steps4-5.trace.json --steps 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# Collectives run on their own streams and spin while they wait for the other ranks: counted apart from the
# compute they may overlap, never as the device being busy.
COLLECTIVE = re.compile(r"nccl|AllGather|ReduceScatter|AllReduce|all_gather|reduce_scatter", re.IGNORECASE)
HOST_CATEGORIES = {"cpu_op", "user_annotation", "python_function"}


def _spans(events, categories):
    return [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e)
        for e in events
        if e.get("ph") == "X" and e.get("cat") in categories
    ]


def busy_intervals(device_spans) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end, _ in sorted(device_spans, key=lambda s: s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def host_stacks(host_by_thread, moments: list[float]) -> list[list[str]]:
    """For each moment, the host ops covering it, outermost first, on the thread whose innermost op began last
    (the one doing something new, not a long caller waiting). One sweep per thread: a thread's ops nest."""
    best: list[tuple[float, list[str]]] = [(float("-inf"), []) for _ in moments]
    order = sorted(range(len(moments)), key=moments.__getitem__)
    for spans in host_by_thread.values():
        spans = sorted(spans, key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, dict]] = []
        i = 0
        for q in order:
            moment = moments[q]
            while i < len(spans) and spans[i][0] <= moment:
                while stack and stack[-1][1] <= spans[i][0]:
                    stack.pop()
                stack.append(spans[i])
                i += 1
            while stack and stack[-1][1] <= moment:
                stack.pop()
            live = [s for s in stack if s[1] > moment]
            if live and live[-1][0] > best[q][0]:
                best[q] = (live[-1][0], [s[2]["name"] for s in live])
    return [names for _, names in best]


def analyse(trace: dict, min_gap_us: float = 20.0) -> dict:
    events = trace.get("traceEvents", [])
    spans = _spans(events, DEVICE_CATEGORIES)
    device = [s for s in spans if not COLLECTIVE.search(s[2].get("name", ""))]
    if not device:
        raise ValueError("no kernels in this trace (was it recorded with ProfilerActivity.CUDA?)")
    busy = busy_intervals(device)
    collectives = busy_intervals([s for s in spans if COLLECTIVE.search(s[2].get("name", ""))])
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in collectives for c, d in busy if c < b and a < d)
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    host_by_thread: dict = defaultdict(list)
    for span in _spans(events, HOST_CATEGORIES):
        host_by_thread[(span[2].get("pid"), span[2].get("tid"))].append(span)
    by_inner: dict = defaultdict(lambda: [0.0, 0])
    by_outer: dict = defaultdict(lambda: [0.0, 0])
    gaps = []
    openings = [
        (end, start)
        for (_, end), (start, _) in zip(busy, busy[1:], strict=False)
        if start - end >= min_gap_us
    ]
    stacks = host_stacks(host_by_thread, [end for end, _ in openings])
    for (end, start), stack in zip(openings, stacks, strict=True):
        stack = stack or ["(between host ops)"]
        inner, outer = stack[-1], stack[0]
        for table, key in ((by_inner, inner), (by_outer, outer)):
            table[key][0] += start - end
            table[key][1] += 1
        gaps.append((start - end, " > ".join(stack[-3:])))
    blocking = defaultdict(lambda: [0.0, 0])
    for start, end, e in _spans(events, {"cuda_runtime", "cuda_driver"}):
        if "Synchronize" in e["name"] or e["name"] == "cudaMemcpy":
            blocking[e["name"]][0] += end - start
            blocking[e["name"]][1] += 1
    gap_total = sum(g for g, _ in gaps)
    return {
        "window_ms": window / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": (window - busy_us) / 1e3,
        "idle_in_gaps_ms": gap_total / 1e3,
        "gaps": len(gaps),
        "collective_ms": sum(b - a for a, b in collectives) / 1e3,
        "collective_exposed_ms": (sum(b - a for a, b in collectives) - hidden) / 1e3,
        "min_gap_us": min_gap_us,
        "by_inner": _ranked(by_inner),
        "by_outer": _ranked(by_outer),
        "largest": [{"us": round(g, 1), "host": h} for g, h in sorted(gaps, reverse=True)[:15]],
        "blocking_calls": _ranked(blocking),
    }


def _ranked(table: dict) -> list[dict]:
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])
    return [{"name": name, "ms": round(us / 1e3, 3), "count": n} for name, (us, n) in rows]


def render(report: dict, steps: int = 1, top: int = 12) -> str:
    per = f" per step (over {steps})" if steps > 1 else ""
    lines = [
        f"device busy {report['busy_ms'] / steps:.2f} ms, idle {report['idle_ms'] / steps:.2f} ms{per}, of which "
        f"{report['idle_in_gaps_ms'] / steps:.2f} ms in {report['gaps']} gaps of >= {report['min_gap_us']:.0f} us "
        f"({100 * report['busy_ms'] / report['window_ms']:.1f}% busy)"
    ]
    if report["collective_ms"]:
        lines.append(
            f"collectives {report['collective_ms'] / steps:.2f} ms{per}, "
            f"{report['collective_exposed_ms'] / steps:.2f} ms of it beside no compute kernel"
        )
    for title, key in (
        ("idle charged to the innermost host op", "by_inner"),
        ("idle charged to the outermost host op", "by_outer"),
        ("host calls that block on the device", "blocking_calls"),
    ):
        lines.append(f"{title}{per}:   ms  count")
        for row in report[key][:top]:
            lines.append(f"  {row['name'][:70]:<70} {row['ms'] / steps:8.2f} {row['count']:6d}")
    lines.append("largest gaps (us, host stack):")
    lines += [f"  {g['us']:9.1f}  {g['host'][:150]}" for g in report["largest"][:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="torch.profiler chrome traces (*.trace.json)")
    parser.add_argument(
        "--steps", type=int, default=1, help="optimizer steps the trace covers, for per-step ms"
    )
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args(argv)
    reports = {}
    for path in args.traces:
        try:
            trace = json.loads(Path(path).read_text())
            reports[path] = analyse(trace, args.min_gap_us)
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"== {path}\n{render(reports[path], args.steps)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
