"""One exception type with an HTTP status, and the parsers that raise it for bad query parameters.

Why one type: every route answers errors the same way (JSON ``{"error", "status"}``), so a script
can tell a bad parameter (400) from an unknown run (404) without parsing prose, and odd input
never turns into a 500.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


class DashboardError(Exception):
    """An error the client caused or can act on; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def to_dict(self) -> dict:
        return {"error": self.message, "status": self.status}


def bad_param(name: str, expected: str, got: str) -> DashboardError:
    return DashboardError(400, f"parameter {name!r} must be {expected}, got {got!r}")


def int_arg(args: Mapping, name: str, default: int | None, lo: int = 0, hi: int = 10**12) -> int | None:
    """An integer query parameter within [lo, hi]; missing or empty gives ``default``."""
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_param(name, f"an integer between {lo} and {hi}", raw) from None
    if not lo <= value <= hi:
        raise bad_param(name, f"an integer between {lo} and {hi}", raw)
    return value


def float_arg(args: Mapping, name: str, default: float | None, lo: float, hi: float) -> float | None:
    """A finite float query parameter within [lo, hi]."""
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise bad_param(name, f"a number between {lo} and {hi}", raw) from None
    if not (math.isfinite(value) and lo <= value <= hi):
        raise bad_param(name, f"a number between {lo} and {hi}", raw)
    return value


def choice_arg(args: Mapping, name: str, choices: tuple[str, ...], default: str) -> str:
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    if raw not in choices:
        raise bad_param(name, "one of " + ", ".join(choices), raw)
    return raw


def bool_arg(args: Mapping, name: str, default: bool = False) -> bool:
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise bad_param(name, "a boolean (1/0, true/false)", raw)
