"""Access control and response hardening for a dashboard that may be reachable on a shared network.

An optional token (``DASHBOARD_TOKEN``) guards every route but ``/health``: scripts send
``Authorization: Bearer <token>``, the browser opens ``/?token=<token>`` once and the page carries
it along. Only GET/HEAD routes exist, so the app cannot change anything by construction.
"""

from __future__ import annotations

import hmac

from flask import current_app, request

from .errors import DashboardError

OPEN_ENDPOINTS = {"api.health"}

# The page uses only its own scripts, styles and images: nothing inline, nothing remote.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def presented_token() -> str | None:
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return request.args.get("token")


def require_token() -> None:
    """``before_request`` hook: 401 unless the configured token (if any) was presented."""
    expected = current_app.config.get("DASHBOARD_TOKEN")
    if not expected or request.endpoint in OPEN_ENDPOINTS:
        return
    given = presented_token()
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise DashboardError(
            401, "a token is required: send 'Authorization: Bearer <token>' or add ?token=<token>"
        )


def harden(response):
    """``after_request`` hook: no sniffing, no framing, no referrer (the URL may carry the token)."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    if response.status_code == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="dashboard"'
    return response
