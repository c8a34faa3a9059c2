"""All-gather bandwidth between the GPUs here: what FSDP pays per layer, to read beside bench_fsdp_gpu.py.

FSDP2 gathers every decoder layer's weights in forward and again in backward. Whether that time hides behind
the layer's compute depends on the link: an 8B layer is 436 MB in bf16, which NVLink moves in about a
millisecond and PCIe in about ten. This prints, per size, the time of one all-gather and its bus bandwidth
(nccl-tests' definition: bytes x (N - 1) / N / time), the median of ``--iters`` after warm-up.

    torchrun --nproc_per_node 2 bench/collectives_gpu.py                 # the GPUs here, NCCL
    torchrun --nproc_per_node 2 bench/collectives_gpu.py --cpu --sizes-mb 1,4   # gloo on CPU: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def time_all_gather(numel: int, device: torch.device, iters: int) -> float:
    """Median seconds of one all-gather of a ``numel``-element bf16 tensor (each rank holds 1/N of it)."""
    world = dist.get_world_size()
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device=device)
    whole = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(iters + 2):  # two warm-ups
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dist.all_gather_into_tensor(whole, shard)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="16,109,436,1002", help="whole tensor sizes in MB (bf16)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    rows = []
    for size_mb in (float(s) for s in args.sizes_mb.split(",")):
        numel = int(size_mb * 1e6 / 2) // world * world
        seconds = time_all_gather(numel, device, args.iters)
        bus = numel * 2 * (world - 1) / world / seconds / 1e9
        rows.append({"mb": size_mb, "ms": round(seconds * 1e3, 3), "bus_gb_s": round(bus, 1), "world": world})
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)"
        print(f"all-gather, {world} ranks, {name}")
        print(f"{'MB':>8} {'ms':>9} {'bus GB/s':>9}")
        for row in rows:
            print(f"{row['mb']:>8g} {row['ms']:>9.3f} {row['bus_gb_s']:>9.1f}")
        print(json.dumps(rows))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
