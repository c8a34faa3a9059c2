"""Security: run names cannot leave the log root, the token guards every route but /health,
responses are hardened, and serving never writes anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dashboard import create_app
from dashboard.__main__ import banner, gunicorn_command, parse_args
from tests.dashboard.fixtures import DEMO
from tests.helpers import REPO


def attack_names(base: Path) -> list[str]:
    secret = base / "secret"
    return [
        "../secret",
        "..%2fsecret",
        "%2e%2e%2fsecret",
        "%2E%2E/secret",
        "..%252fsecret",
        "....//secret",
        "..\\secret",
        f"{DEMO}/../../secret",
        f"{DEMO}/../escape",
        "escape",  # a symlink inside the root that points outside it
        "escape/",
        str(secret),
        str(secret).replace("/", "%2f"),
        "/etc",
        "/etc/passwd",
        f"{DEMO}/logs",
        f"{DEMO}/checkpoint-20",
        ".",
        "..",
        f"{DEMO}%00",
        f"{DEMO}/",
    ]


ATTACK_URLS = (
    "/api/stats?run={}",
    "/api/metrics?run={}",
    "/api/plots/loss.png?run={}",
    "/api/plots/loss.png?compare={}",
    "/?run={}",
)


def test_path_traversal_attempts_are_404(client, tmp_path: Path):
    for name in attack_names(tmp_path):
        for pattern in ATTACK_URLS:
            url = pattern.format(name)
            response = client.get(url)
            assert response.status_code == 404, (url, response.status_code)
            assert b"hunter2" not in response.data and b"9.99" not in response.data


def test_the_symlinked_run_is_not_listed(client):
    names = [r["name"] for r in client.get("/api/runs").get_json()["runs"]]
    assert "escape" not in names and not any("secret" in n for n in names)


AUDIT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    root, urls = sys.argv[1], json.loads(sys.argv[2])
    from dashboard import create_app
    client = create_app(root).test_client()
    client.get("/api/plots/loss.png")  # warm up imports and font caches before watching
    seen = []
    def hook(event, args):
        if event == "open":
            seen.append([os.fspath(args[0]) if not isinstance(args[0], int) else "", str(args[1]), args[2] or 0])
        elif event in ("os.listdir", "os.scandir"):
            seen.append([os.fspath(args[0] or "."), "list", 0])
    sys.addaudithook(hook)
    statuses = [client.get(url).status_code for url in urls]
    print(json.dumps({"seen": seen, "statuses": statuses}))
    """
)


def test_nothing_outside_the_root_is_opened_and_nothing_is_written(log_root: Path, tmp_path: Path):
    """Watch every open() and directory listing (Python audit hooks) while serving attacks and normal pages."""
    urls = [pattern.format(name) for name in attack_names(tmp_path) for pattern in ATTACK_URLS]
    urls += [
        "/",
        "/api/runs",
        "/api/stats",
        "/api/checkpoints",
        "/api/metrics",
        "/api/events",
        "/api/gpu",
        "/api/experts",
    ]
    urls += [
        "/api/plots/loss.png?log=1",
        "/api/plots/experts.png",
        "/metrics?all=1",
        f"/api/stats?run={DEMO}",
    ]
    result = subprocess.run(
        [sys.executable, "-c", AUDIT_SCRIPT, str(log_root), json.dumps(urls)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["statuses"][-12:] == [200] * 12
    secret = os.path.realpath(tmp_path / "secret")
    root = os.path.realpath(log_root)
    touched = [os.path.realpath(path) for path, _, _ in report["seen"] if path]
    assert not [p for p in touched if p.startswith(secret)]
    assert any(p.startswith(root) for p in touched)  # the hook did watch the reads
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    writes = [
        (path, mode)
        for path, mode, flags in report["seen"]
        if path
        and os.path.realpath(path).startswith(root)
        and (any(c in mode for c in "wax+") or (mode == "None" and flags & write_flags))
    ]
    assert writes == []


def snapshot(folder: Path) -> dict:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if not p.is_symlink()
    }


def test_serving_leaves_run_folders_untouched(client, log_root: Path):
    before = snapshot(log_root)
    for url in (
        "/",
        "/api/stats",
        "/api/checkpoints",
        "/api/plots/loss.png",
        "/api/plots/experts.png",
        "/metrics?all=1",
    ):
        assert client.get(url).status_code == 200
    assert snapshot(log_root) == before


# ---------------------------------------------------------------- token


@pytest.fixture
def guarded(log_root: Path):
    return create_app(log_root, {"TESTING": True, "DASHBOARD_TOKEN": "s3cret-token"}).test_client()


@pytest.mark.parametrize(
    "url",
    ["/", "/api/runs", "/api/stats", "/api/metrics", "/api/plots/loss.png", "/metrics", "/static/app.js"],
)
def test_token_required_on_every_route_but_health(guarded, url: str):
    assert guarded.get(url).status_code == 401
    assert guarded.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get(f"{url}{'&' if '?' in url else '?'}token=wrong").status_code == 401
    assert guarded.get(url, headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert guarded.get(f"{url}{'&' if '?' in url else '?'}token=s3cret-token").status_code == 200


def test_token_errors_and_health(guarded):
    response = guarded.get("/api/stats")
    assert response.get_json() == {"error": response.get_json()["error"], "status": 401}
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert guarded.get("/health").status_code == 200


def test_page_carries_the_token_along(guarded):
    html = guarded.get("/?token=s3cret-token").get_data(as_text=True)
    assert 'data-token="s3cret-token"' in html
    assert "/static/app.js?token=s3cret-token" in html and "/static/style.css?token=s3cret-token" in html


def test_token_from_environment(log_root: Path, monkeypatch):
    monkeypatch.setenv("DASHBOARD_TOKEN", "from-env")
    client = create_app(log_root).test_client()
    assert client.get("/api/stats").status_code == 401
    assert client.get("/api/stats", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_security_headers(client):
    response = client.get("/")
    csp = response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "http" not in csp
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "no-referrer"


def test_page_uses_only_local_assets(client):
    html = client.get("/").get_data(as_text=True)
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    for asset in ("app.js", "style.css"):
        body = client.get(f"/static/{asset}").get_data(as_text=True)
        assert "http://" not in body and "https://" not in body


# ---------------------------------------------------------------- binding


def test_binds_to_loopback_by_default_and_warns_elsewhere_without_token():
    args = parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 5000)
    quiet = banner(args, token=None)
    assert not any(line.startswith("WARNING") for line in quiet)
    assert any("http://127.0.0.1:5000/" in line for line in quiet) and any("LAN" in line for line in quiet)
    exposed = banner(parse_args(["--host", "0.0.0.0", "--port", "5050"]), token=None)
    assert any(line.startswith("WARNING") and "DASHBOARD_TOKEN" in line for line in exposed)
    guarded = banner(parse_args(["--host", "0.0.0.0"]), token="t0k")
    assert not any(line.startswith("WARNING") for line in guarded)
    assert any("?token=t0k" in line for line in guarded)


def test_gunicorn_runs_one_worker_with_threads():
    command = gunicorn_command(parse_args(["--port", "5051", "--host", "::1"]))
    assert command[command.index("--workers") + 1] == "1"
    assert "[::1]:5051" in command and command[-1] == "dashboard:create_app()"
