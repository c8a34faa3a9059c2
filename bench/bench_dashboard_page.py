"""Benchmark: the dashboard page as a user meets it, served by gunicorn (``python -m dashboard``).

On a run folder of N training records (default 1,000,000, built as bench/bench_dashboard.py does):
1. time to first chart: headless Chromium opens the page, until the loss chart holds points (cold:
   the server's first read of the log; warm: a reload);
2. the server's CPU while a run appends ``--rate`` records/s and the page stays open polling every
   ``--interval`` s (what the dashboard takes from a trainer on the same node);
3. load: ``ab`` (apache2-utils) on /api/stats and on the page's own poll (/api/series since the last
   step) at 5 and 20 concurrent clients, while the run appends.

    python bench/bench_dashboard_page.py                   # prints a Markdown section
    python bench/bench_dashboard_page.py --records 20000 --cpu-seconds 10 --requests 500
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from bench.bench_dashboard import RUN, Appender, build_run, free_port  # noqa: E402


def wait_ready(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the dashboard did not answer")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1600",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def first_chart_seconds(driver, url: str) -> float:
    """From navigation start to the loss chart drawn with points, as the browser clocks it."""
    driver.get(url)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = driver.execute_script(
            "const f = document.querySelector(\"figure[data-chart='loss']\");"
            "return f && Number(f.dataset.points) > 0 ? performance.now() : null;"
        )
        if done:
            return done / 1000.0
        time.sleep(0.02)
    raise SystemExit("the loss chart never drew")


def server_cpu(pid: int) -> float:
    """CPU seconds used by gunicorn's master and workers."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def ab(url: str, requests: int, concurrency: int) -> dict:
    out = subprocess.run(
        ["ab", "-q", "-n", str(requests), "-c", str(concurrency), url],
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    grab = lambda pattern: float(re.search(pattern, out).group(1))  # noqa: E731
    return {
        "rps": grab(r"Requests per second:\s+([\d.]+)"),
        # "Length" failures are responses of another length (live data changes), not errors.
        "failed": sum(int(n) for n in re.findall(r"(?:Connect|Receive|Exceptions): (\d+)", out))
        + (int(grab(r"Non-2xx responses:\s+(\d+)")) if "Non-2xx" in out else 0),
        "p50": grab(r"\s50%\s+(\d+)"),
        "p99": grab(r"\s99%\s+(\d+)"),
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=10.0, help="records appended per second meanwhile")
    parser.add_argument("--interval", type=float, default=5.0, help="the page's refresh interval")
    parser.add_argument("--cpu-seconds", type=float, default=60.0)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    if not shutil.which("ab"):
        raise SystemExit("ab not found: apt-get install apache2-utils")
    root = Path(tempfile.mkdtemp(prefix="bench-page-"))
    run = build_run(root, args.records)
    size = (run / "logs" / "training_log.jsonl").stat().st_size
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--logdir", str(root), "--port", str(port), "--server", "gunicorn", "--nice", "0"],
        env=harness.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    appender = None
    driver = browser()
    try:
        wait_ready(port)
        page = f"http://127.0.0.1:{port}/?run={RUN}&interval={args.interval}"
        cold = first_chart_seconds(driver, page)
        warm = first_chart_seconds(driver, page)
        appender = Appender(run, args.records + 1, args.rate)
        appender.start()
        time.sleep(2)
        before, started = server_cpu(server.pid), time.monotonic()
        time.sleep(args.cpu_seconds)
        cpu = (server_cpu(server.pid) - before) / (time.monotonic() - started)
        driver.get("about:blank")
        base = f"http://127.0.0.1:{port}"
        last = appender.step
        loads = []
        for label, path in (
            ("/api/stats", f"/api/stats?run={RUN}"),
            ("the page's poll (/api/series since the last step)", f"/api/series?run={RUN}&field=loss,lr,grad_norm,tokens_per_sec,peak_mem_mb&since_step={last}"),
            ("the page's first chart data (/api/series, 4,000 rows)", f"/api/series?run={RUN}&field=loss,lr,grad_norm,tokens_per_sec,peak_mem_mb&max_points=4000"),
        ):  # fmt: skip
            for concurrency in (5, 20):
                requests = args.requests if "4,000" not in label else max(50, args.requests // 20)
                loads.append({"route": label, "c": concurrency, **ab(base + path, requests, concurrency)})
    finally:
        if appender:
            appender.stop.set()
        driver.quit()
        server.terminate()
        server.wait(timeout=20)
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    load_rows = []
    for r in loads:
        counts = [r["route"], r["c"], f"{r['requests']:,}", r["failed"], f"{r['rps']:.0f}"]
        load_rows.append(counts + [f"{r['p50']:.0f} ms", f"{r['p99']:.0f} ms"])
    lines = [
        "## Dashboard page (issue 15)",
        "",
        f"`python bench/bench_dashboard_page.py`: gunicorn (`python -m dashboard --server gunicorn`, one worker, 4 threads) "
        f"over a run of {args.records:,} training records ({size / 1e6:.0f} MB), {args.rate:g} records/s appended while measuring; "
        f"headless Chromium on the same machine; {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} at the end "
        "(other jobs share the machine: absolute times vary).",
        "",
        f"- Time to first chart (navigation to the loss chart drawn): **{cold:.2f} s** cold (the server reads the whole log once), "
        f"**{warm:.2f} s** on a reload.",
        f"- Dashboard server CPU while the run appends and the page polls every {args.interval:g} s: "
        f"**{100 * cpu:.1f}% of one core** (averaged over {args.cpu_seconds:g} s).",
        "",
        harness.markdown_table(
            ["route (ab, loopback)", "concurrent", "requests", "failed", "req/s", "p50", "p99"], load_rows
        ),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
