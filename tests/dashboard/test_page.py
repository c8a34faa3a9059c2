"""The HTML page (server side), the import isolation from the training stack, and the launcher."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard.__main__ import parse_args
from dashboard.views import format_duration, format_number
from tests.dashboard.fixtures import DEMO, LAST_STEP, NUMBER_CASES
from tests.helpers import REPO
from trainer.runfolder.plots import PLOT_NAMES


def initial_data(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="initial-data">(.*?)</script>', html, re.S)
    return json.loads(match.group(1))


def test_page_shows_the_same_numbers_as_the_api(client):
    html = client.get("/").get_data(as_text=True)
    assert '<strong data-stat="step">40</strong>' in html
    assert 'data-stat="status">running<' in html
    data = initial_data(html)
    api = client.get("/api/stats").get_json()
    for key in (
        "run",
        "step",
        "total_steps",
        "loss",
        "loss_smoothed",
        "best_eval",
        "last_checkpoint",
        "error_count",
    ):
        assert data["stats"][key] == api[key]
    assert data["checkpoints"] == client.get("/api/checkpoints").get_json()
    assert data["run"] == DEMO and data["stats"]["step"] == LAST_STEP


def test_page_has_every_part(client):
    html = client.get("/").get_data(as_text=True)
    for name in PLOT_NAMES:
        assert f'data-plot="{name}"' in html
    for part in ("run-picker", "compare-picker", "interval-picker", "progress-fill", "checkpoint-table", "gpu-cards",
                 "event-timeline", "error-panel", "eval-table", "smoothing", "log-y"):  # fmt: skip
        assert f'id="{part}"' in html
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in html
    options = re.findall(r'<option value="([^"]+)" ?(?:selected)?>[^<]*\((\w+)\)</option>', html)
    assert (DEMO, "running") in options and ("failed", "failed") in options


def test_page_for_a_chosen_run_and_interval(client):
    html = client.get("/?run=failed&interval=2").get_data(as_text=True)
    data = initial_data(html)
    assert data["run"] == "failed" and data["errors"]["count"] == 1
    assert 'data-interval="2.0"' in html
    assert client.get("/?interval=0").status_code == 400


@pytest.mark.parametrize("text, digits, shown", NUMBER_CASES)
def test_numbers_are_shown_one_way(text, digits, shown):
    """Thousands separators and no exponent from 1,000 up; the browser test holds static/charts.js to the same."""
    assert format_number(float(text), digits) == shown


def test_counts_durations_and_missing_values_in_the_page(client):
    assert (format_number(40980), format_number(None), format_number(True)) == ("40,980", "-", "-")
    # As app.js writes them, so a card reads the same before and after the page refreshes it.
    durations = [format_duration(s) for s in (None, 9.4, 65, 3600, 3725, 2 * 86400 + 4 * 3600)]
    assert durations == ["-", "9 s", "1 min 5 s", "1 h", "1 h 2 min", "2 days 4 h"]
    html = client.get("/").get_data(as_text=True)
    assert 'data-stat="tokens_per_sec">1,040<' in html  # the demo run's last step: 1000.0 + 40


ISOLATION_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from dashboard import create_app
    client = create_app(sys.argv[1]).test_client()
    statuses = [client.get(url).status_code for url in
                ["/", "/api/stats", "/api/metrics", "/api/checkpoints", "/api/experts", "/api/plots/loss.png",
                 "/api/plots/experts.png", "/metrics"]]
    print(json.dumps({"statuses": statuses, "modules": sorted(sys.modules)}))
    """
)
HEAVY = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "datasets",
    "safetensors",
    "tokenizers",
    "fla",
)


def test_serving_imports_nothing_from_the_training_stack(log_root: Path):
    result = subprocess.run(
        [sys.executable, "-c", ISOLATION_SCRIPT, str(log_root)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["statuses"] == [200] * 8
    modules = report["modules"]
    assert [m for m in modules if m.split(".")[0] in HEAVY] == []
    trainer_modules = [m for m in modules if m.startswith("trainer")]
    assert "trainer.runfolder" in trainer_modules  # the check itself is live
    assert [m for m in trainer_modules if m != "trainer" and not m.startswith("trainer.runfolder")] == []
    assert "flask" in modules and "matplotlib" in modules  # the check itself is live


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, timeout: float = 20.0) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("server", ["gunicorn", "flask"])
def test_launch_script_serves_the_dashboard(log_root: Path, server: str):
    port = free_port()
    env = dict(os.environ, DASHBOARD_PYTHON=sys.executable)
    env.pop("DASHBOARD_TOKEN", None)
    process = subprocess.Popen(
        [
            str(REPO / "launch_dashboard.sh"),
            "--logdir",
            str(log_root),
            "--port",
            str(port),
            "--server",
            server,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd="/",
    )
    try:
        assert json.loads(wait_for(f"http://127.0.0.1:{port}/health")) == {"status": "ok"}
        stats = json.loads(wait_for(f"http://127.0.0.1:{port}/api/stats"))
        assert stats["run"] == DEMO and stats["step"] == LAST_STEP
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0].decode()
    assert f"http://127.0.0.1:{port}/" in output and "LAN:" in output
    assert "WARNING" not in output
    if server == "gunicorn":
        assert "gunicorn" in output.lower()


def test_launcher_arguments(capsys):
    with pytest.raises(SystemExit) as bad:
        parse_args(["--port", "99999"])
    assert bad.value.code == 2 and "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as shown:
        parse_args(["--help"])
    assert shown.value.code == 0 and "--logdir" in capsys.readouterr().out
    args = parse_args(["--logdir", "elsewhere", "--server", "flask"])
    assert (args.logdir, args.server, args.nice) == ("elsewhere", "flask", 10)
