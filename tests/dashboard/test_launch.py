"""launch_dashboard.sh: a taken port is one line and exit 2; the URLs appear only once the server answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.helpers import REPO


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(tmp_path, port: int, server: str) -> subprocess.Popen:
    env = dict(os.environ, DASHBOARD_PYTHON=sys.executable)
    env.pop("DASHBOARD_TOKEN", None)
    return subprocess.Popen(
        [
            str(REPO / "launch_dashboard.sh"),
            "--logdir",
            str(tmp_path),
            "--port",
            str(port),
            "--server",
            server,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


@pytest.mark.parametrize("server", ["gunicorn", "flask"])
def test_a_port_in_use_is_one_line_and_exit_2(tmp_path, server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = start(tmp_path, port, server)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert err.strip().splitlines() == [
        f"launch_dashboard.sh: error: port {port} on 127.0.0.1 is already in use "
        "(another dashboard?); choose another with --port"
    ]
    assert "http://" not in out


@pytest.mark.parametrize("server", ["gunicorn", "flask"])
def test_urls_are_printed_once_the_server_answers(tmp_path, server):
    port = free_port()
    process = start(tmp_path, port, server)
    try:
        for line in process.stdout:
            if line.startswith("  local:"):
                break
        else:
            pytest.fail(f"no URL printed; stderr: {process.stderr.read()[-2000:]}")
        # No retry: the page must answer the moment its address is shown.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            assert response.status == 200
    finally:
        process.terminate()
        process.communicate(timeout=20)
