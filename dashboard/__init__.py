"""Read-only web dashboard over the trainer's run folders (see docs/dashboard.md).

``create_app(log_root)`` is the Flask app factory: gunicorn serves ``dashboard:create_app()``
(log root from ``DASHBOARD_LOGDIR``), tests call it with a temporary folder.
Imports nothing from the training stack: only Flask, numpy, matplotlib and the run-folder library
``trainer.runfolder`` (standard library only, plus numpy/matplotlib for its plots).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flask import Flask, jsonify, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import HTTPException

from .errors import DashboardError
from .runs import RunRegistry, StallPolicy

if TYPE_CHECKING:
    from .plot_cache import PlotCache


def _finite(value):
    """NaN and infinities as null, at any depth: the API always emits standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class StrictJSONProvider(DefaultJSONProvider):
    """Flask's JSON, but never a bare NaN (which JavaScript's JSON.parse rejects)."""

    def dumps(self, obj, **kwargs):
        kwargs.setdefault("default", self.default)
        try:
            return json.dumps(obj, allow_nan=False, **kwargs)
        except ValueError:
            return json.dumps(_finite(obj), allow_nan=False, **kwargs)


@dataclass
class DashboardState:
    """What the routes share: the runs, the stall policy and the rendered-plot cache."""

    registry: RunRegistry
    policy: StallPolicy
    plot_cache: PlotCache


def create_app(log_root: str | os.PathLike | None = None, test_config: dict | None = None) -> Flask:
    """Build the app for the run folders under ``log_root`` (default: $DASHBOARD_LOGDIR, else ./runs)."""
    from . import api, auth, overview, views  # here, so `python -m dashboard --help` stays quick
    from .assets import asset_root
    from .plot_cache import PlotCache

    assets = asset_root()
    app = Flask(__name__, template_folder=str(assets / "templates"), static_folder=str(assets / "static"))
    app.json = StrictJSONProvider(app)
    app.config.from_mapping(
        DASHBOARD_TOKEN=os.environ.get("DASHBOARD_TOKEN") or None,
        DASHBOARD_POLL_SECONDS=float(os.environ.get("DASHBOARD_POLL_SECONDS", "5")),
        DASHBOARD_STALL_FACTOR=10.0,
        DASHBOARD_STALL_MIN_SECONDS=60.0,
        DASHBOARD_STARTUP_SECONDS=900.0,
        DASHBOARD_DISCOVERY_TTL=2.0,
    )
    if test_config:
        app.config.from_mapping(test_config)
    root = Path(log_root or os.environ.get("DASHBOARD_LOGDIR") or "runs").resolve()
    policy = StallPolicy(
        factor=app.config["DASHBOARD_STALL_FACTOR"],
        min_seconds=app.config["DASHBOARD_STALL_MIN_SECONDS"],
        startup_seconds=app.config["DASHBOARD_STARTUP_SECONDS"],
    )
    registry = RunRegistry(root, ttl=app.config["DASHBOARD_DISCOVERY_TTL"])
    app.extensions["dashboard"] = DashboardState(registry, policy, PlotCache())
    app.config["DASHBOARD_LOG_ROOT"] = str(root)

    app.before_request(auth.require_token)
    app.after_request(auth.harden)
    app.register_blueprint(api.bp)
    app.register_blueprint(views.bp)
    app.register_blueprint(overview.bp)
    register_error_handlers(app)
    return app


def wants_html() -> bool:
    return (
        not request.path.startswith(("/api/", "/metrics", "/health")) and request.accept_mimetypes.accept_html
    )


def register_error_handlers(app: Flask) -> None:
    """Every error is ``{"error", "status"}`` JSON (the page gets a short HTML version)."""
    from .views import error_page

    def answer(status: int, message: str):
        if wants_html():
            return error_page(status, message)
        return jsonify(error=message, status=status), status

    @app.errorhandler(DashboardError)
    def dashboard_error(error: DashboardError):
        return answer(error.status, error.message)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        return answer(error.code or 500, error.description or error.name)

    @app.errorhandler(Exception)
    def unexpected(error: Exception):
        app.logger.exception("unexpected error")
        return answer(500, f"internal error ({type(error).__name__}); see the server log")
