"""Run notifications: a webhook (a JSON POST that Slack's incoming webhooks accept) and, when
``notify.email_config`` is set, e-mail through ``trainer.monitor.notify_email``; plus a stall watchdog.

A notification must never hurt the run: ``notify`` never raises, waits at most
``notify.timeout_seconds`` (each channel sends in a daemon thread, so even a server that accepts
and then hangs cannot hold training longer), and a failure is one line on stderr.

The loop's side: ``notifier.notify("start", {...})`` (also arms the watchdog),
``notifier.heartbeat(step)`` after every optimizer step, ``notify("finish" | "failure" |
"interrupt", {...})`` at the end (which disarms it), ``close()`` in any case.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from trainer.config import NotifyConfig
from trainer.runfolder import clean_value

EVENTS = ("start", "finish", "failure", "interrupt", "stall")
TERMINAL_EVENTS = ("finish", "failure", "interrupt")
HEADLINES = {
    "start": "started",
    "finish": "finished",
    "failure": "FAILED",
    "interrupt": "was interrupted",
    "stall": "STALLED",
}
MAX_TEXT = 3000


class Notifier:
    """Sends run events to the configured channels; a no-op when none is configured or ``enabled`` is False."""

    def __init__(self, cfg: NotifyConfig, run_name: str = "", enabled: bool = True, host: str | None = None):
        self.cfg = cfg
        self.run_name = run_name
        self.host = host or socket.gethostname()
        self.enabled = enabled and bool(cfg.webhook_url or cfg.email_config)
        self._last_beat = time.monotonic()
        self._last_step: int | None = None
        self._stalled = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config, run_name: str = "", enabled: bool = True) -> Notifier:
        """From a whole ``Config`` (its ``notify`` section) or a ``NotifyConfig``."""
        return cls(getattr(config, "notify", config), run_name, enabled)

    # ---------------------------------------------------------------- sending

    def notify(self, event: str, info: dict | None = None) -> bool:
        """Send ``event`` to every configured channel; True when all of them took it. Never raises."""
        try:
            if event == "start":
                self.start_watchdog()
            elif event in TERMINAL_EVENTS:
                self.stop_watchdog()
            if not self.enabled or event not in self.cfg.events:
                return False
            payload = self.payload(event, info or {})
            channels = []
            if self.cfg.webhook_url:
                channels.append(("webhook", lambda: self._post(payload)))
            if self.cfg.email_config:
                channels.append(("email", lambda: self._email(event, payload)))
            return self._deliver(channels, event)
        except Exception as exc:  # noqa: BLE001 - a notification must never take the run down
            self._warn("notify", event, f"{type(exc).__name__}: {exc}")
            return False

    def payload(self, event: str, info: dict) -> dict:
        """``text`` for Slack and people; ``event``, ``run``, ``host``, ``ts`` and ``info`` for scripts."""
        info = clean_value(dict(info), "", [])
        headline = f"finetune run `{self.run_name or '?'}` {HEADLINES.get(event, event)} on {self.host}"
        details = ", ".join(f"{k} {_short(v)}" for k, v in info.items() if _is_scalar(v))
        text = f"{headline}: {details}" if details else headline
        return {
            "text": text[:MAX_TEXT],
            "event": event,
            "run": self.run_name,
            "host": self.host,
            "ts": round(time.time(), 3),
            "info": info,
        }

    def _deliver(self, channels, event: str) -> bool:
        """Send on every channel at once, each in a daemon thread; wait at most timeout_seconds in all."""
        running = []
        for name, send in channels:
            box: dict = {}

            def target(send=send, box=box):
                try:
                    box["ok"] = bool(send())
                except TimeoutError:  # the sender's own clock ran out: the same event as the join's
                    box["timed_out"] = True
                except Exception as exc:  # noqa: BLE001
                    box["error"] = f"{type(exc).__name__}: {exc}"

            thread = threading.Thread(target=target, name=f"notify-{name}", daemon=True)
            thread.start()
            running.append((name, thread, box))
        deadline = time.monotonic() + self.cfg.timeout_seconds
        delivered = True
        for name, thread, box in running:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive() or box.get("timed_out"):
                reason = f"no answer within {self.cfg.timeout_seconds:g} s"
            elif name == "email" and "error" not in box:
                reason = None  # send_email_notification warns itself, and False may mean "filtered out"
            else:
                reason = box.get("error") or (None if box.get("ok") else "the sender reported failure")
            if reason:
                self._warn(name, event, reason)
                delivered = False
            elif not box.get("ok"):
                delivered = False
        return delivered

    def _post(self, payload: dict) -> bool:
        body = json.dumps(payload, default=str, allow_nan=False).encode()
        request = urllib.request.Request(
            self.cfg.webhook_url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "finetune-kit-notify"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_seconds) as response:
                if not 200 <= response.status < 300:
                    raise RuntimeError(f"HTTP {response.status}")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise exc.reason from None
            raise RuntimeError(str(exc.reason)) from None
        return True

    def _email(self, event: str, payload: dict) -> bool:
        try:
            from trainer.monitor.notify_email import send_email_notification
        except ModuleNotFoundError as exc:
            if exc.name != "trainer.monitor.notify_email":
                raise
            raise RuntimeError(
                "notify.email_config is set but trainer/monitor/notify_email.py is missing"
            ) from None
        info = {**payload["info"], "run": self.run_name, "host": self.host, "text": payload["text"]}
        return bool(send_email_notification(self.cfg.email_config, event, info, self.cfg.timeout_seconds))

    def _warn(self, channel: str, event: str, reason: str) -> None:
        where = ""
        if channel == "webhook" and self.cfg.webhook_url:
            # The host only: a Slack webhook URL is a secret and log files travel.
            where = f" to {urllib.parse.urlsplit(self.cfg.webhook_url).hostname}"
        reason = " ".join(str(reason).split())[:300]
        print(
            f"notify: {channel} '{event}'{where} not delivered: {reason} (training goes on)", file=sys.stderr
        )

    # ---------------------------------------------------------------- stall watchdog

    def heartbeat(self, step: int) -> None:
        """A step completed: cheap enough to call every step (re-arms the stall alarm)."""
        self._last_beat = time.monotonic()
        self._last_step = step
        self._stalled = False
        if self._watchdog is None:
            self.start_watchdog()

    def start_watchdog(self) -> None:
        """Fire ``stall`` once when no heartbeat came for ``stall_minutes`` (again after the next one)."""
        with self._lock:
            if self._watchdog is not None or not self.enabled or "stall" not in self.cfg.events:
                return
            self._last_beat = time.monotonic()
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="notify-stall-watchdog", daemon=True)
            self._watchdog.start()

    def stop_watchdog(self) -> None:
        with self._lock:
            thread, self._watchdog = self._watchdog, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def close(self) -> None:
        self.stop_watchdog()

    def _watch(self) -> None:
        limit = self.cfg.stall_minutes * 60.0
        poll = min(30.0, max(0.02, limit / 10))
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last_beat
            if idle >= limit and not self._stalled:
                self._stalled = True
                self.notify(
                    "stall",
                    {
                        "last_step": self._last_step,
                        "idle_minutes": round(idle / 60.0, 2),
                        "stall_minutes": self.cfg.stall_minutes,
                    },
                )


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."
