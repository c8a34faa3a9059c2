"""Benchmark: the dashboard's incremental reader against a naive one that re-reads the log per request.

Builds a run folder whose training log holds N records (default 1,000,000), serves it in a
subprocess, and measures from outside, over HTTP, while 100 records per second are appended:
the first /api/stats (which parses the whole log), then p50/p99 of later /api/stats and
/api/metrics calls, and the server's resident memory (now and peak). The naive server answers the
same two routes by re-reading the file with ``runlog.iter_records`` on every request.

    python bench/bench_dashboard.py                       # the full benchmark (a few minutes)
    python bench/bench_dashboard.py --records 20000 --calls 20 --naive-calls 3
    python bench/bench_dashboard.py --write-results bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from trainer import runfolder as runlog  # noqa: E402

RUN = "bench-run"
ABOUT = (
    "`python bench/bench_dashboard.py`: a run folder whose training log holds the records below, served by "
    "`create_app` (werkzeug's threaded server, in a subprocess) and timed from outside over HTTP while a "
    "writer appends records. Targets: later calls p50 under 20 ms, resident memory under 300 MB. "
    "`/api/metrics` returns the loss downsampled to 1,000 points. The incremental reader parses the log once "
    "(the first call) and then only what was appended since the previous request; the naive reader "
    "(`runlog.iter_records` + `last_per_step` on every request) pays the whole log each time, in time and, "
    "as Python dicts, in peak memory."
)


# ---------------------------------------------------------------- the log


def record(step: int, ts: float, total: int) -> dict:
    loss = 2.0 + 1.0 / (1.0 + step / 1000.0) + 0.05 * ((step * 7919) % 100) / 100.0
    return {
        "ts": round(ts, 3),
        "step": step,
        "total_steps": total,
        "epoch": round(step / 50000, 5),
        "loss": round(loss, 6),
        "lr": 2e-4,
        "grad_norm": 0.8,
        "tokens": 65536,
        "tokens_per_sec": 30500.0,
        "steps_per_sec": 0.47,
        "eta_seconds": float(total - step),
        "elapsed": float(step),
        "peak_mem_mb": 14800.0,
    }


def build_run(root: Path, records: int) -> Path:
    run = root / RUN
    (run / runlog.LOGS_DIR).mkdir(parents=True)
    start = time.time() - records * 0.01
    total = records * 2
    runlog.write_json_atomic(
        run / runlog.RUN_JSON, {"run_id": RUN, "status": "running", "started_at": start, "total_steps": total}
    )
    with open(run / runlog.LOGS_DIR / runlog.TRAINING_LOG, "w", encoding="utf-8") as handle:
        for step in range(1, records + 1):
            handle.write(runlog.encode_record(record(step, start + step * 0.01, total)))
    return run


class Appender(threading.Thread):
    """Appends ``rate`` records per second (one at a time, flushed) like a running trainer."""

    def __init__(self, run: Path, first_step: int, rate: float):
        super().__init__(daemon=True)
        self.path = run / runlog.LOGS_DIR / runlog.TRAINING_LOG
        self.step = first_step
        self.rate = rate
        self.stop = threading.Event()

    def run(self) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            started = time.monotonic()
            written = 0
            while not self.stop.is_set():
                due = int((time.monotonic() - started) * self.rate)
                while written < due:
                    handle.write(runlog.encode_record(record(self.step, time.time(), self.step * 2)))
                    handle.flush()
                    self.step += 1
                    written += 1
                self.stop.wait(0.005)


# ---------------------------------------------------------------- the servers


def naive_app(root: Path):
    """What a dashboard without offsets does: re-read and re-parse the whole log on every request."""
    import numpy as np
    from flask import Flask, jsonify, request

    from trainer.runfolder.series import downsample_indices, last_ema

    app = Flask("naive")
    log = root / RUN / runlog.LOGS_DIR / runlog.TRAINING_LOG

    def records() -> list[dict]:
        return runlog.last_per_step(list(runlog.iter_records(log)))

    @app.get("/api/stats")
    def stats():
        rows = records()
        last = rows[-1]
        losses = [r["loss"] for r in rows[-400:]]
        return jsonify(
            step=last["step"], loss=last["loss"], loss_smoothed=last_ema(losses), records=len(rows)
        )

    @app.get("/api/metrics")
    def metrics():
        rows = records()
        field = request.args.get("field", "loss")
        values = np.array([r.get(field, np.nan) for r in rows], dtype=float)
        keep = downsample_indices(values, int(request.args.get("max_points", 1000)))
        points = [[rows[i]["ts"], rows[i]["step"], values[i]] for i in keep.tolist()]
        return jsonify(
            series={field: {"points": points, "total": len(rows), "dropped": len(rows) - len(points)}}
        )

    return app


def serve(kind: str, root: Path, port: int) -> None:
    import logging

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    if kind == "real":
        from dashboard import create_app

        app = create_app(root)
    else:
        app = naive_app(root)
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) of a process in MB, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = lambda name: int(re.search(rf"^{name}:\s+(\d+) kB", status, re.M).group(1)) / 1024  # noqa: E731
    return field("VmRSS"), field("VmHWM")


def fetch(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        response.read()
        assert response.status == 200
    return (time.perf_counter() - started) * 1000


def wait_ready(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(kind: str, root: Path, run: Path, calls: int, rate: float, first_step: int) -> dict:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--root", str(root), "--port", str(port)], cwd=REPO
    )
    appender = Appender(run, first_step, rate)
    try:
        wait_ready(port, process)
        base = f"http://127.0.0.1:{port}"
        first = fetch(f"{base}/api/stats?run={RUN}")
        appender.start()
        stats, metrics = [], []
        for _ in range(calls):
            time.sleep(0.05)  # a polling client, with records arriving in between
            stats.append(fetch(f"{base}/api/stats?run={RUN}"))
            metrics.append(fetch(f"{base}/api/metrics?run={RUN}&field=loss&max_points=1000"))
        rss, peak = memory_mb(process.pid)
        appender.stop.set()
        appender.join(timeout=10)
        # Everything appended while measuring has been read (the reader never loses a record).
        final = json.loads(urllib.request.urlopen(f"{base}/api/stats?run={RUN}", timeout=600).read())
    finally:
        appender.stop.set()
        process.terminate()
        process.wait(timeout=30)
    result = {
        "kind": kind,
        "first": first,
        "stats_p50": percentile(stats, 50),
        "stats_p99": percentile(stats, 99),
        "metrics_p50": percentile(metrics, 50),
        "metrics_p99": percentile(metrics, 99),
        "rss": rss,
        "peak": peak,
        "calls": calls,
        "appended": appender.step - first_step,
        "final_step": final["step"],
        "next_step": appender.step,
    }
    print(f"{kind}: {result}", file=sys.stderr)
    return result


def table(results: list[dict], records: int, rate: float) -> str:
    about = (
        f"Training log: {records:,} records ({records * 230 / 1e6:.0f} MB-ish), {rate:g} records/s appended while measuring; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end (other jobs share the machine: absolute times vary)."
    )
    header = ["reader", "first /api/stats", "/api/stats p50", "/api/stats p99", "/api/metrics p50"]
    header += ["/api/metrics p99", "RSS", "peak RSS", "calls", "appended meanwhile"]
    rows = []
    for r in results:
        name = "incremental (dashboard)" if r["kind"] == "real" else "naive (re-read per request)"
        times = [f"{r[k]:.1f} ms" for k in ("stats_p50", "stats_p99", "metrics_p50", "metrics_p99")]
        memory = [f"{r['rss']:.0f} MB", f"{r['peak']:.0f} MB"]
        rows.append([name, f"{r['first'] / 1000:.2f} s", *times, *memory, r["calls"], f"{r['appended']:,}"])
    return about + "\n\n" + harness.markdown_table(header, rows)


def write_results(path: Path, body: str) -> None:
    """Replace (or add) the "## Dashboard" section of RESULTS.md, leaving other sections alone."""
    section = f"## Dashboard\n\n{ABOUT}\n\n{body}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(r"^## Dashboard\n.*?(?=^## |\Z)", re.S | re.M)
    text = (
        pattern.sub(lambda _: section + "\n", text)
        if pattern.search(text)
        else text.rstrip("\n") + "\n\n" + section
    )
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--calls", type=int, default=200, help="later calls per endpoint, incremental reader")
    parser.add_argument(
        "--naive-calls", type=int, default=5, help="later calls per endpoint, naive reader (slow)"
    )
    parser.add_argument(
        "--rate", type=float, default=100.0, help="records appended per second while measuring"
    )
    parser.add_argument("--write-results", type=Path, help="update the Dashboard section of this RESULTS.md")
    parser.add_argument("--serve", choices=("real", "naive"), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.root, args.port)
        return
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        run = build_run(root, args.records)
        print(f"built {args.records:,} records in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        real = measure("real", root, run, args.calls, args.rate, args.records + 1)
        naive = measure("naive", root, run, args.naive_calls, args.rate, real["next_step"])
    for result in (real, naive):
        assert result["final_step"] == result["next_step"] - 1, result
    body = table([real, naive], args.records, args.rate)
    print(body)
    if args.write_results:
        write_results(args.write_results, body)


if __name__ == "__main__":
    main()
