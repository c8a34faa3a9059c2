"""E-mail notifications against a small SMTP server started here (real smtplib on the client side),
a refused port, a server that never answers, and a server that refuses the login."""

from __future__ import annotations

import base64
import email
import logging
import socket
import socketserver
import threading
import time

import pytest

from trainer.monitor.notify_email import EmailSettingsError, load_settings, send_email_notification

PASSWORD = "s3cret-Pa55word"


class SMTPServer:
    """Just enough ESMTP for smtplib: EHLO, AUTH PLAIN/LOGIN, MAIL, RCPT, DATA, QUIT."""

    def __init__(self, user: str = "bot@example.org", password: str = PASSWORD):
        self.messages: list[dict] = []
        self.logins: list[tuple[str, str]] = []
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def say(self, line: str) -> None:
                self.wfile.write(line.encode() + b"\r\n")

            def handle(self):
                self.say("220 test ESMTP")
                envelope = {"from": None, "to": []}
                while True:
                    raw = self.rfile.readline()
                    if not raw:
                        return
                    command = raw.decode().rstrip("\r\n")
                    verb = command.split(" ", 1)[0].upper()
                    if verb in ("EHLO", "HELO"):
                        self.wfile.write(b"250-test\r\n250-AUTH PLAIN LOGIN\r\n250 SIZE 100000\r\n")
                    elif verb == "AUTH":
                        parts = command.split()
                        if parts[1].upper() == "PLAIN":
                            _, name, secret = base64.b64decode(parts[2]).decode().split("\0")
                        else:
                            self.say("334 VXNlcm5hbWU6")
                            name = base64.b64decode(self.rfile.readline().strip()).decode()
                            self.say("334 UGFzc3dvcmQ6")
                            secret = base64.b64decode(self.rfile.readline().strip()).decode()
                        server.logins.append((name, secret))
                        ok = (name, secret) == (user, password)
                        self.say("235 2.7.0 accepted" if ok else "535 5.7.8 authentication failed")
                    elif verb == "MAIL":
                        envelope["from"] = command.split(":", 1)[1].strip("<> ").split()[0].strip("<>")
                        self.say("250 OK")
                    elif verb == "RCPT":
                        envelope["to"].append(command.split(":", 1)[1].strip("<> "))
                        self.say("250 OK")
                    elif verb == "DATA":
                        self.say("354 end with .")
                        lines = []
                        while (line := self.rfile.readline()) not in (b".\r\n", b""):
                            lines.append(line)
                        server.messages.append(
                            {**envelope, "message": email.message_from_bytes(b"".join(lines))}
                        )
                        self.say("250 queued")
                    elif verb == "QUIT":
                        self.say("221 bye")
                        return
                    else:
                        self.say("250 OK")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def smtp_server():
    server = SMTPServer()
    yield server
    server.close()


def settings_file(tmp_path, port: int, body: str = "", name: str = "smtp.yaml"):
    path = tmp_path / name
    path.write_text(
        f"host: 127.0.0.1\nport: {port}\nsecurity: none\nusername: bot@example.org\n"
        "password_env: TEST_SMTP_PASSWORD\nto: [me@example.org, team@example.org]\n" + body
    )
    return str(path)


def test_finish_mail_reaches_the_server_with_login_and_no_secrets(tmp_path, smtp_server, monkeypatch, caplog):
    monkeypatch.setenv("TEST_SMTP_PASSWORD", PASSWORD)
    path = settings_file(tmp_path, smtp_server.port)
    info = {"run_id": "run-42", "step": 120, "total_steps": 120, "best_metric": 1.25, "hf_token": "hf_abc"}
    with caplog.at_level(logging.DEBUG):
        assert send_email_notification(path, "finish", info, timeout=5) is True
    assert smtp_server.logins == [("bot@example.org", PASSWORD)]
    [sent] = smtp_server.messages
    assert sent["from"] == "bot@example.org"
    assert sent["to"] == ["me@example.org", "team@example.org"]
    message = sent["message"]
    assert message["Subject"] == "[finetune-kit] run-42 finished at step 120/120"
    body = message.get_payload()
    assert "best_metric: 1.25" in body and "hf_token: (hidden)" in body and "hf_abc" not in body
    assert PASSWORD not in body and PASSWORD not in caplog.text


@pytest.mark.parametrize(
    "event, title", [("start", "started"), ("failure", "FAILED"), ("interrupt", "interrupted")]
)
def test_each_run_event_sends_its_subject(tmp_path, smtp_server, monkeypatch, event, title):
    monkeypatch.setenv("TEST_SMTP_PASSWORD", PASSWORD)
    path = settings_file(tmp_path, smtp_server.port)
    assert send_email_notification(path, event, {"run_id": "r", "step": 3, "error": "ValueError"}, 5)
    assert smtp_server.messages[-1]["message"]["Subject"] == f"[finetune-kit] r {title} at step 3"


def test_ini_settings_and_event_filter(tmp_path, smtp_server):
    path = tmp_path / "smtp.ini"
    path.write_text(
        f"[smtp]\nhost = 127.0.0.1\nport = {smtp_server.port}\nstarttls = false\n"
        "from = kit@example.org\nto = a@example.org, b@example.org\nevents = failure\n"
    )
    assert send_email_notification(str(path), "finish", {"run_id": "r"}, 5) is False  # filtered out
    assert send_email_notification(str(path), "failure", {"run_id": "r"}, 5) is True
    assert smtp_server.logins == []  # no username: no login
    [sent] = smtp_server.messages
    assert sent["to"] == ["a@example.org", "b@example.org"] and sent["from"] == "kit@example.org"


def test_refused_login_is_one_warning_without_the_password(tmp_path, smtp_server, monkeypatch, caplog):
    monkeypatch.setenv("TEST_SMTP_PASSWORD", "wrong-" + PASSWORD)
    path = settings_file(tmp_path, smtp_server.port)
    with caplog.at_level(logging.WARNING):
        assert send_email_notification(path, "finish", {"run_id": "r"}, timeout=5) is False
    assert smtp_server.messages == []
    [record] = caplog.records
    assert "SMTPAuthenticationError" in record.getMessage() and "\n" not in record.getMessage()
    assert PASSWORD not in caplog.text


def test_refused_port_and_silent_server_fail_fast_without_raising(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TEST_SMTP_PASSWORD", PASSWORD)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()  # accepts connections (backlog) but never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with caplog.at_level(logging.WARNING):
            assert send_email_notification(settings_file(tmp_path, refused_port), "start", {}, 2) is False
            started = time.monotonic()
            path = settings_file(tmp_path, silent.getsockname()[1], name="silent.yaml")
            assert send_email_notification(path, "start", {}, timeout=0.5) is False
            assert time.monotonic() - started < 3
    finally:
        silent.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "ConnectionRefusedError" in messages[0] and f"127.0.0.1:{refused_port}" in messages[0]
    assert "timed out after 0.5s" in messages[1]
    assert PASSWORD not in caplog.text


def test_settings_errors_name_the_field_and_never_raise_from_send(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TEST_SMTP_PASSWORD", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 25\nto: [a@example.org]\n")
    with pytest.raises(EmailSettingsError, match="'host' is missing"):
        load_settings(bad)
    with pytest.raises(EmailSettingsError, match="TEST_SMTP_PASSWORD, which is not set"):
        load_settings(settings_file(tmp_path, 25))
    bad.write_text(f"host: h\nto: a@example.org\nusername: u\npassword: {PASSWORD}\nsecurity: tls\n")
    with pytest.raises(EmailSettingsError, match="'security' must be starttls, ssl or none"):
        load_settings(bad)
    bad.write_text(f"host: h\nto: a@example.org\nusername: u\npassword: {PASSWORD}\n")
    settings = load_settings(bad)
    assert (settings.port, settings.security, settings.sender) == (587, "starttls", "u")
    assert PASSWORD not in repr(settings)
    with caplog.at_level(logging.WARNING):
        assert send_email_notification(str(tmp_path / "missing.yaml"), "finish", {}, 1) is False
    assert "email settings file not found" in caplog.text


def test_run_notifier_delivers_email_through_this_module(tmp_path, smtp_server, monkeypatch):
    """The training loop's Notifier (trainer/monitor/notify.py) with only notify.email_config set."""
    from trainer.config import NotifyConfig
    from trainer.monitor.notify import Notifier

    monkeypatch.setenv("TEST_SMTP_PASSWORD", PASSWORD)
    notifier = Notifier(
        NotifyConfig(email_config=settings_file(tmp_path, smtp_server.port)), run_name="tiny-run"
    )
    try:
        assert notifier.notify("start", {"total_steps": 12}) is True
        assert notifier.notify("interrupt", {"step": 4, "total_steps": 12}) is True
    finally:
        notifier.close()
    subjects = [m["message"]["Subject"] for m in smtp_server.messages]
    assert subjects == ["[finetune-kit] tiny-run started", "[finetune-kit] tiny-run interrupted at step 4/12"]
