"""The benchmark script runs end to end (on a small log) and updates only its RESULTS.md section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_benchmark_small_run_writes_its_section(tmp_path: Path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Dashboard\n\nold numbers\n\n## Trainer\n\nkeep me\n")
    done = subprocess.run(
        [
            sys.executable,
            "bench/bench_dashboard.py",
            "--records",
            "3000",
            "--calls",
            "5",
            "--naive-calls",
            "2",
            "--write-results",
            str(results),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "incremental (dashboard)",
        "naive (re-read per request)",
    ]
    text = results.read_text()
    assert "old numbers" not in text and "keep me" in text and text.count("## Dashboard") == 1
    assert rows[0] in text
