"""What is live at a run's peak device memory, grouped by the code that allocated it: reads a CUDA caching
allocator snapshot with its history (``bench/memory_history`` records one per trainer process).

Why: peak memory against Unsloth's is a target of issue 31, and the run's ``peak_mem_mb`` says how much, not
what. Two things make the device hold more than ``max_memory_allocated`` says:
- a block freed while another stream still uses it (``record_stream``) stops counting as allocated at once,
  but is occupied until that stream is done, which is late when the host runs ahead of the device;
- a CUDA graph's private pool keeps the tensors a captured call allocates and frees reserved after capture
  (every replay writes them again). The kit's ``peak_mem_mb`` adds those unallocated pool bytes
  (``layer_graphs.CudaGraphs.unseen_bytes_now``).
So from the last capture on this counts each block until its free completed, plus the pools' unallocated
bytes: what the device must hold, at least what ``peak_mem_mb`` reports. A block allocated in a pool's free
memory after capture (the loss, ``CudaGraphs.run_in_free_memory``) is the pool's, counted once with it: such
blocks are known by their address, inside a pool's segment.

    PYTHONPATH=bench/memory_history:$PYTHONPATH MEMORY_HISTORY_DIR=/tmp/mh python -m trainer train --config c.yaml
    python bench/memory_peak.py /tmp/mh/*.pickle --top 25
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

GRAPH_FILES = ("layer_graphs.py", "stack_graphs.py")  # where the kit captures (``CudaGraphs.capture``)
LIBRARY_FRAMES = ("/torch/", "contextlib.py", "functools.py", "<frozen")
MIB = 2**20


def captured(frames: list[dict]) -> bool:
    """Allocated inside a CUDA graph capture: into the graphs' private pool."""
    return any(f.get("name") == "capture" and f.get("filename", "").endswith(GRAPH_FILES) for f in frames)


def short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for package in ("/trainer/", "/bench/", "/tests/"):
        if package in filename:
            return package[1:] + filename.rsplit(package, 1)[1]
    return filename.rsplit("/", 1)[-1]


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own code: the line that asked for the memory."""
    for frame in frames:
        if not any(part in frame.get("filename", "") for part in LIBRARY_FRAMES):
            return f"{short(frame['filename'])}:{frame.get('line')} {frame.get('name')}"
    return "torch (no caller recorded)"


def kit_caller(frames: list[dict]) -> str:
    """The innermost frame in the kit's own ``trainer/`` package: which part of the step it belongs to."""
    for frame in frames:
        if "/trainer/" in frame.get("filename", ""):
            return f"{short(frame['filename'])}:{frame.get('line')} {frame.get('name')}"
    return "-"


@dataclass
class Peak:
    events: int
    allocated_peak: int  # the allocator's max_memory_allocated over the history
    occupied_peak: int  # the same, counting a block until its free completes (a stream using it is done)
    pool_reserved: int  # the graphs' private pools at the end: segments' total size
    pool_allocated: int
    after_capture: int | None  # index of the event after which the non-captured allocated bytes peaked
    after_capture_bytes: int
    before_history: int  # allocated bytes the history never saw being allocated (a wrapped ring buffer)
    live: dict = field(default_factory=dict)  # (site, kit caller) -> [bytes, blocks], at ``after_capture``
    captured_peak: int = 0  # the most bytes captured calls held at once: what sizes the pools
    captured_live: dict = field(default_factory=dict)  # (site, kit caller) -> [bytes, blocks], at that moment


def private_pools(segments: list[dict]) -> tuple[int, int]:
    pools = [s for s in segments if tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0)]
    return sum(s["total_size"] for s in pools), sum(s["allocated_size"] for s in pools)


def pool_ranges(segments: list[dict]) -> list[tuple[int, int]]:
    """The address ranges of the graphs' private pools' segments (a snapshot's segments carry ``address``)."""
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in segments
        if tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0) and "address" in s
    ]


def in_pools(event: dict, ranges: list[tuple[int, int]]) -> bool:
    """Captured, or lent the pool's free memory later: either way the pool's bytes, not beside them."""
    return captured(event.get("frames") or []) or any(start <= event["addr"] < end for start, end in ranges)


def _peak(events: list[dict], freed_by: str) -> int:
    """The most bytes allocated at once, a block counted until its ``freed_by`` event."""
    sizes: dict[int, int] = {}
    total = peak = 0
    for event in events:
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
        elif event["action"] == freed_by and event["addr"] in sizes:
            total -= sizes.pop(event["addr"])
        peak = max(peak, total)
    return peak


def analyse(snapshot: dict, device: int = 0) -> Peak:
    events = snapshot["device_traces"][device]
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    peak = _peak(events, "free_requested")
    live: dict[int, dict] = {}
    total = occupied = 0
    last_capture = -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if captured(event.get("frames") or []):
                last_capture = i
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        occupied = max(occupied, total)
    before = max(0, sum(s["allocated_size"] for s in segments) - total)
    reserved, pool_allocated = private_pools(segments)
    # Second pass: from the last capture on, the bytes allocated outside the pools and where they peak.
    ranges = pool_ranges(segments)
    live.clear()
    total, best, best_at = 0, -1, None
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            if not in_pools(event, ranges):
                live[event["addr"]] = event
                total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if i >= last_capture and total > best:
            best, best_at = total, i
    live.clear()
    if best_at is not None:
        for event in events[: best_at + 1]:
            if event["action"] == "alloc" and not in_pools(event, ranges):
                live[event["addr"]] = event
            elif event["action"] == "free_completed":
                live.pop(event["addr"], None)
    captured_peak, captured_live = _captured_peak(events)
    return Peak(
        len(events),
        peak + before,
        occupied + before,
        reserved,
        pool_allocated,
        best_at,
        max(best, 0) + before,
        before,
        _group(live.values()),
        captured_peak,
        captured_live,
    )


def _group(blocks) -> dict:
    groups: dict = defaultdict(lambda: [0, 0])
    for event in blocks:
        frames = event.get("frames") or []
        group = groups[(site(frames), kit_caller(frames))]
        group[0] += event["size"]
        group[1] += 1
    return dict(groups)


def _captured_peak(events: list[dict]) -> tuple[int, dict]:
    """What the captured calls held at their largest moment: the pool is at least that big, so this is what a
    smaller pool has to shrink (its transients are the peak's graphs' cost, bench/RESULTS.md session 35)."""
    live: dict[int, dict] = {}
    total = best = 0
    at_best: list[dict] = []
    for event in events:
        if event["action"] == "alloc" and captured(event.get("frames") or []):
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, at_best = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return best, _group(at_best)


def _table(groups: dict, top: int) -> list[str]:
    lines = ["| MiB | blocks | site | in trainer/ |", "|---|---|---|---|"]
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    for (where, caller), (size, blocks) in ranked[:top]:
        lines.append(f"| {size / MIB:.1f} | {blocks} | {where} | {caller} |")
    rest = ranked[top:]
    if rest:
        lines.append(f"| {sum(s for _, (s, _) in rest) / MIB:.1f} | {sum(b for _, (_, b) in rest)} | "
                     f"{len(rest)} other sites | |")  # fmt: skip
    return lines


def report(peak: Peak, top: int) -> str:
    unallocated = peak.pool_reserved - peak.pool_allocated
    lines = [
        f"{peak.events} allocator events; allocated bytes the history did not see allocated: "
        f"{peak.before_history / MIB:.0f} MiB",
        f"allocator peak (max_memory_allocated): {peak.allocated_peak / MIB:.0f} MiB; counting each block until "
        f"its free completed (after the streams that used it): {peak.occupied_peak / MIB:.0f} MiB",
        f"graph pools at the end: {peak.pool_reserved / MIB:.0f} MiB reserved, {peak.pool_allocated / MIB:.0f} MiB "
        f"of it allocated",
        f"peak from the last capture on: {peak.after_capture_bytes / MIB:.0f} MiB occupied outside the pools + "
        f"{unallocated / MIB:.0f} MiB unallocated in them = {(peak.after_capture_bytes + unallocated) / MIB:.0f} "
        f"MiB (event {peak.after_capture})",
        "",
        "occupied outside the pools at that peak, by the line that allocated it:",
        *_table(peak.live, top),
    ]
    if peak.captured_peak:
        lines += [
            "",
            f"held at once inside the captured calls, at most: {peak.captured_peak / MIB:.0f} MiB (what sizes the "
            "pools), by the line that allocated it:",
            *_table(peak.captured_live, top),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "snapshots", nargs="+", type=Path, help="pickles from torch.cuda.memory._dump_snapshot"
    )
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    for path in args.snapshots:
        try:
            snapshot = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            print(f"error: {path}: not a readable allocator snapshot ({exc})", file=sys.stderr)
            return 2
        if "device_traces" not in snapshot or len(snapshot["device_traces"]) <= args.device:
            print(f"error: {path}: no history for device {args.device} (record it: bench/memory_history)",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"== {path}")
        print(report(analyse(snapshot, args.device), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
