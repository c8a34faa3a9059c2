"""E-mail notifications (run start, finish, failure, interrupt), beside the webhook.

SMTP settings live in their own file, kept out of the repository and named by
``notify.email_config``: YAML (``.yaml``/``.yml``) or INI (a ``[smtp]`` section). Fields:

    host: smtp.example.org        # required
    port: 587                     # default: 465 with ssl, 587 with starttls, else 25
    security: starttls            # starttls (default), ssl, or none; or starttls: true / ssl: true
    username: me@example.org      # optional: no login without it
    password_env: SMTP_PASSWORD   # read the password from this variable (or: password: ...)
    from: me@example.org          # default: username
    to: [me@example.org, team@example.org]   # a list, or one comma-separated string
    subject_prefix: "[finetune-kit]"         # optional
    events: [finish, failure]     # optional: send only these

The password is never logged or put in a message. A mail server that is down, slow or refuses the
login costs one warning line and ``False``: a notification never harms the run.
"""

from __future__ import annotations

import configparser
import logging
import os
import smtplib
import socket
import ssl
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path

log = logging.getLogger(__name__)

EVENTS = ("start", "finish", "failure", "interrupt", "stall")
TITLES = {
    "start": "started",
    "finish": "finished",
    "failure": "FAILED",
    "interrupt": "interrupted",
    "stall": "stalled",
}
SECRET_WORDS = ("password", "token", "secret", "authorization")


class EmailSettingsError(ValueError):
    """The SMTP settings file is missing, unreadable or incomplete; the message names the field."""


@dataclass
class EmailSettings:
    host: str
    port: int
    security: str  # "starttls", "ssl" or "none"
    username: str | None
    password: str | None = field(repr=False)
    sender: str
    recipients: list[str]
    subject_prefix: str = "[finetune-kit]"
    events: list[str] | None = None
    source: str = ""


def _read_raw(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".ini", ".cfg", ".conf"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(text)
        except configparser.Error as exc:
            raise EmailSettingsError(f"{path}: not a valid INI file ({type(exc).__name__})") from exc
        section = "smtp" if parser.has_section("smtp") else (parser.sections() or [None])[0]
        if section is None:
            raise EmailSettingsError(f"{path}: expected an [smtp] section")
        return dict(parser.items(section))
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EmailSettingsError(f"{path}: not valid YAML") from exc
    if isinstance(raw, dict) and isinstance(raw.get("smtp"), dict):
        raw = raw["smtp"]
    if not isinstance(raw, dict):
        raise EmailSettingsError(f"{path}: expected a mapping of SMTP settings")
    return raw


def _flag(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _address_list(value) -> list[str]:
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list):
        return []
    return [str(v).strip() for v in value if str(v).strip()]


def load_settings(path: str | os.PathLike) -> EmailSettings:
    """Read and check the settings file; raise EmailSettingsError naming the first problem."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise EmailSettingsError(f"email settings file not found: {path}")
    raw = {str(k).lower(): v for k, v in _read_raw(path).items()}
    host = str(raw.get("host") or "").strip()
    if not host:
        raise EmailSettingsError(f"{path}: 'host' is missing")
    security = str(raw.get("security") or "").strip().lower()
    if not security:
        security = (
            "ssl" if _flag(raw.get("ssl")) else "starttls" if _flag(raw.get("starttls", True)) else "none"
        )
    if security not in ("starttls", "ssl", "none"):
        raise EmailSettingsError(f"{path}: 'security' must be starttls, ssl or none, got {security!r}")
    default_port = {"ssl": 465, "starttls": 587, "none": 25}[security]
    try:
        port = int(raw.get("port") or default_port)
    except (TypeError, ValueError):
        raise EmailSettingsError(f"{path}: 'port' must be a number, got {raw.get('port')!r}") from None
    username = str(raw["username"]).strip() if raw.get("username") else None
    password = raw.get("password")
    if password is None and raw.get("password_env"):
        password = os.environ.get(str(raw["password_env"]))
        if password is None:
            raise EmailSettingsError(f"{path}: password_env names {raw['password_env']}, which is not set")
    if username and password is None:
        raise EmailSettingsError(f"{path}: 'username' is set but neither 'password' nor 'password_env'")
    recipients = _address_list(raw.get("to"))
    if not recipients:
        raise EmailSettingsError(f"{path}: 'to' is missing (a list of addresses)")
    sender = str(raw.get("from") or username or "").strip()
    if not sender:
        raise EmailSettingsError(f"{path}: 'from' is missing (and no username to use instead)")
    events = _address_list(raw.get("events")) or None
    unknown = [e for e in events or () if e not in EVENTS]
    if unknown:
        raise EmailSettingsError(f"{path}: unknown event {unknown[0]!r} (valid: {', '.join(EVENTS)})")
    return EmailSettings(
        host=host,
        port=port,
        security=security,
        username=username,
        password=None if password is None else str(password),
        sender=sender,
        recipients=recipients,
        subject_prefix=str(raw.get("subject_prefix", "[finetune-kit]")),
        events=events,
        source=str(path),
    )


def _safe(key: str, value) -> str:
    if any(word in key.lower() for word in SECRET_WORDS):
        return "(hidden)"
    return str(value)


def build_message(settings: EmailSettings, event: str, info: dict) -> EmailMessage:
    run = info.get("run_id") or info.get("run") or info.get("output_dir") or "run"
    title = TITLES.get(event, event)
    step = info.get("step")
    total = info.get("total_steps")
    progress = (
        f" at step {step}/{total}" if step is not None and total else (f" at step {step}" if step else "")
    )
    message = EmailMessage()
    message["Subject"] = f"{settings.subject_prefix} {run} {title}{progress}".strip()
    message["From"] = settings.sender
    message["To"] = ", ".join(settings.recipients)
    lines = [f"Run {run} {title}{progress}.", ""]
    lines += [f"{key}: {_safe(key, value)}" for key, value in info.items() if value is not None]
    message.set_content("\n".join(lines) + "\n")
    return message


def _scrub(text: str, settings: EmailSettings | None) -> str:
    if settings is not None and settings.password:
        text = text.replace(settings.password, "***")
    return " ".join(text.split())[:300]


def send(settings: EmailSettings, message: EmailMessage, timeout: float) -> None:
    if settings.security == "ssl":
        client = smtplib.SMTP_SSL(
            settings.host, settings.port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        client = smtplib.SMTP(settings.host, settings.port, timeout=timeout)
    with client:
        client.ehlo()
        if settings.security == "starttls":
            client.starttls(context=ssl.create_default_context())
            client.ehlo()
        if settings.username:
            client.login(settings.username, settings.password or "")
        client.send_message(message)


def send_email_notification(settings_path: str, event: str, info: dict, timeout: float) -> bool:
    """Send one notification; True when the server accepted it. Never raises: a failure (bad settings,
    connection refused, timeout, login refused) is one warning line without the password, and False."""
    settings = None
    try:
        settings = load_settings(settings_path)
        if settings.events is not None and event not in settings.events:
            return False
        send(settings, build_message(settings, event, info), timeout)
        return True
    except Exception as exc:  # noqa: BLE001 - a notification must never take the run down
        where = f"{settings.host}:{settings.port}" if settings is not None else str(settings_path)
        reason, detail = exc.__class__.__name__, _scrub(str(exc), settings)
        if isinstance(exc, (socket.timeout, TimeoutError)) or detail.endswith("timed out"):
            reason, detail = f"timed out after {timeout:g}s", ""
        log.warning(
            "email notification (%s) not sent via %s: %s%s",
            event,
            where,
            reason,
            f": {detail}" if detail else "",
        )
        return False
