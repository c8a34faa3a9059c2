"""Notifications: the webhook's payload, failures that never reach the run, timeouts, e-mail, the stall watchdog."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import wait_for
from trainer.config import NotifyConfig
from trainer.monitor.notify import Notifier


class Receiver:
    """A local webhook endpoint that records every POST (path, headers, JSON body)."""

    def __init__(self, status: int = 200):
        self.posts: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/SECRET"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def events(self) -> list[str]:
        return [json.loads(p["body"])["event"] for p in self.posts]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_posts_slack_compatible_json_with_structured_fields(receiver):
    notifier = Notifier(NotifyConfig(webhook_url=receiver.url), run_name="demo", host="node7")
    info = {"model": "configs/tiny-moe", "total_steps": 240, "loss": float("nan"), "nested": {"a": [1, 2]}}
    assert notifier.notify("start", info) is True
    notifier.close()
    (post,) = receiver.posts
    assert post["path"] == "/services/T000/SECRET"
    assert post["headers"]["Content-Type"] == "application/json"
    assert b"NaN" not in post["body"]  # strict JSON: Slack and any parser read it
    payload = json.loads(post["body"])
    assert payload["event"] == "start" and payload["run"] == "demo" and payload["host"] == "node7"
    assert payload["text"].startswith("finetune run `demo` started on node7")
    assert "total_steps 240" in payload["text"] and "configs/tiny-moe" in payload["text"]
    assert payload["info"]["loss"] is None and payload["info"]["nested"] == {"a": [1, 2]}
    assert abs(payload["ts"] - time.time()) < 60


def test_only_configured_events_are_sent(receiver):
    notifier = Notifier(NotifyConfig(webhook_url=receiver.url, events=["failure"]), run_name="demo")
    assert notifier.notify("start", {}) is False
    assert notifier.notify("failure", {"error": "ValueError: boom", "step": 3}) is True
    assert receiver.events() == ["failure"]
    assert "FAILED" in json.loads(receiver.posts[0]["body"])["text"]


def test_nothing_configured_is_a_quiet_no_op(capsys):
    notifier = Notifier(NotifyConfig(), run_name="demo")
    assert notifier.notify("start", {"x": 1}) is False
    notifier.heartbeat(1)
    assert notifier._watchdog is None
    assert capsys.readouterr().err == ""


def test_refused_port_returns_false_fast_with_one_line_and_no_secret(capsys):
    url = f"http://127.0.0.1:{free_port()}/services/T000/SECRET"
    notifier = Notifier(NotifyConfig(webhook_url=url, timeout_seconds=5), run_name="demo")
    started = time.monotonic()
    assert notifier.notify("finish", {"step": 12}) is False
    assert time.monotonic() - started < 2.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "webhook 'finish'" in err and "not delivered" in err
    assert "SECRET" not in err and "127.0.0.1" in err


def test_http_error_status_is_a_failure(capsys):
    server = Receiver(status=500)
    try:
        notifier = Notifier(NotifyConfig(webhook_url=server.url), run_name="demo")
        assert notifier.notify("start", {}) is False
        assert len(server.posts) == 1
        assert "HTTP 500" in capsys.readouterr().err
    finally:
        server.close()


def test_hanging_server_costs_at_most_the_timeout(capsys):
    # Listens (so the connection opens) but never reads or answers.
    with socket.socket() as hang:
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)
        url = f"http://127.0.0.1:{hang.getsockname()[1]}/hook"
        notifier = Notifier(NotifyConfig(webhook_url=url, timeout_seconds=0.5), run_name="demo")
        started = time.monotonic()
        assert notifier.notify("failure", {"step": 1}) is False
        elapsed = time.monotonic() - started
    assert 0.4 < elapsed < 1.5, elapsed
    assert "no answer within 0.5 s" in capsys.readouterr().err


def test_a_sender_that_times_out_first_reads_like_no_answer(capsys, monkeypatch):
    # urlopen's own timeout and the join deadline are the same length: whichever fires first,
    # the user reads one message.
    notifier = Notifier(
        NotifyConfig(webhook_url="http://127.0.0.1:9/hook", timeout_seconds=0.5), run_name="demo"
    )

    def times_out(payload):
        raise TimeoutError("timed out")

    monkeypatch.setattr(notifier, "_post", times_out)
    assert notifier.notify("failure", {"step": 1}) is False
    err = capsys.readouterr().err
    assert "no answer within 0.5 s" in err and "TimeoutError" not in err


def test_email_channel_is_called_lazily_beside_the_webhook(receiver, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("trainer.monitor.notify_email")
    fake.send_email_notification = lambda path, event, info, timeout: (
        calls.append((path, event, info, timeout)) or True
    )
    monkeypatch.setitem(sys.modules, "trainer.monitor.notify_email", fake)
    settings = tmp_path / "email.yaml"
    settings.write_text("to: me@example.org\n")
    cfg = NotifyConfig(webhook_url=receiver.url, email_config=str(settings), timeout_seconds=3)
    assert Notifier(cfg, run_name="demo", host="h").notify("finish", {"step": 240, "final_loss": 0.5}) is True
    ((path, event, info, timeout),) = calls
    assert (path, event, timeout) == (str(settings), "finish", 3)
    assert info["step"] == 240 and info["run"] == "demo" and "finished" in info["text"]
    assert receiver.events() == ["finish"]


def test_missing_or_failing_email_module_never_raises(tmp_path, monkeypatch, capsys):
    settings = tmp_path / "email.yaml"
    settings.write_text("to: me@example.org\n")
    cfg = NotifyConfig(email_config=str(settings), timeout_seconds=1)
    monkeypatch.setitem(sys.modules, "trainer.monitor.notify_email", None)  # import fails
    assert Notifier(cfg, run_name="demo").notify("start", {}) is False
    assert "notify_email.py is missing" in capsys.readouterr().err

    broken = types.ModuleType("trainer.monitor.notify_email")

    def explode(*args):
        raise OSError("SMTP server said no")

    broken.send_email_notification = explode
    monkeypatch.setitem(sys.modules, "trainer.monitor.notify_email", broken)
    assert Notifier(cfg, run_name="demo").notify("start", {}) is False
    assert "SMTP server said no" in capsys.readouterr().err


def test_stall_fires_once_then_rearms_after_a_step_and_stops_at_finish(receiver):
    cfg = NotifyConfig(webhook_url=receiver.url, stall_minutes=0.005)  # 0.3 s
    notifier = Notifier(cfg, run_name="demo")
    try:
        assert notifier.notify("start", {}) is True
        notifier.heartbeat(7)
        assert wait_for(lambda: receiver.events().count("stall") == 1, timeout=5)
        time.sleep(0.8)  # still stalled: no second alarm
        assert receiver.events().count("stall") == 1
        stall = json.loads(receiver.posts[-1]["body"])
        assert stall["info"]["last_step"] == 7 and stall["info"]["idle_minutes"] >= 0.005
        assert "STALLED" in stall["text"]

        notifier.heartbeat(8)  # training moved again: the next stall is news
        assert wait_for(lambda: receiver.events().count("stall") == 2, timeout=5)
        notifier.notify("finish", {})
        time.sleep(0.8)
        assert receiver.events().count("stall") == 2 and receiver.events()[-1] == "finish"
    finally:
        notifier.close()


def test_steady_heartbeats_never_look_like_a_stall(receiver):
    notifier = Notifier(NotifyConfig(webhook_url=receiver.url, stall_minutes=0.01), run_name="demo")  # 0.6 s
    try:
        for step in range(30):
            notifier.heartbeat(step)
            time.sleep(0.05)
        assert notifier._watchdog is not None and notifier._watchdog.is_alive()
        assert receiver.events() == []
    finally:
        notifier.close()
    assert notifier._watchdog is None


class FakeSmtp:
    """Just enough SMTP (no TLS, no login) to accept one message per connection and keep its text."""

    def __init__(self):
        self.messages: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as rfile:
                conn.sendall(b"220 fake\r\n")
                for line in rfile:
                    verb = line[:4].upper()
                    if verb == b"DATA":
                        conn.sendall(b"354 go on\r\n")
                        body = []
                        for data in rfile:
                            if data == b".\r\n":
                                break
                            body.append(data.decode())
                        self.messages.append("".join(body))
                        conn.sendall(b"250 queued\r\n")
                    elif verb == b"QUIT":
                        conn.sendall(b"221 bye\r\n")
                        break
                    else:
                        conn.sendall(b"250 ok\r\n")

    def close(self):
        self.sock.close()


def test_real_email_module_gets_the_event(receiver, tmp_path):
    """With trainer/monitor/notify_email.py present, one Notifier drives both channels."""
    smtp = FakeSmtp()
    try:
        settings = tmp_path / "email.yaml"
        settings.write_text(
            f"host: 127.0.0.1\nport: {smtp.port}\nsecurity: none\nfrom: kit@example.org\nto: me@example.org\n"
        )
        cfg = NotifyConfig(webhook_url=receiver.url, email_config=str(settings), timeout_seconds=5)
        notifier = Notifier(cfg, run_name="demo", host="node7")
        assert notifier.notify("failure", {"step": 3, "total_steps": 12, "error": "ValueError: boom"}) is True
        (message,) = smtp.messages
        assert "demo FAILED at step 3/12" in message and "error: ValueError: boom" in message
        assert receiver.events() == ["failure"]
    finally:
        smtp.close()
    refused = tmp_path / "refused.yaml"
    refused.write_text(
        f"host: 127.0.0.1\nport: {free_port()}\nsecurity: none\nfrom: a@b.c\nto: me@example.org\n"
    )
    started = time.monotonic()
    assert Notifier(NotifyConfig(email_config=str(refused), timeout_seconds=5)).notify("finish", {}) is False
    assert time.monotonic() - started < 2.0
