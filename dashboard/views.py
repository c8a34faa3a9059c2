"""The page: rendered from the same data functions as the API, then kept fresh by static/app.js."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from flask import Blueprint, current_app, render_template, request, url_for

from trainer.runfolder import summaries

from . import devices, run_stats, run_tables
from .errors import DashboardError, float_arg
from .runs import age_words

bp = Blueprint("views", __name__)

POLL_CHOICES = (1, 2, 5, 10, 30, 60)
TABS = (
    ("charts", "charts"),
    ("evals", "evaluations"),
    ("checkpoints", "checkpoints"),
    ("events", "events"),
    ("devices", "devices"),
    ("config", "config"),
)


@dataclass(frozen=True)
class ChartSpec:
    """A chart on the page: which series it draws (static/charts.js) and its matplotlib PNG, if any."""

    name: str
    title: str
    png: str | None = None
    hide_when_empty: bool = False


CHARTS = (
    ChartSpec("loss", "loss", "loss"),
    ChartSpec("lr", "learning rate", "lr"),
    ChartSpec("throughput", "throughput (tokens/s)", "throughput"),
    ChartSpec("grad_norm", "gradient norm", "grad_norm"),
    ChartSpec("memory", "peak memory (MiB)", "memory"),
    ChartSpec("gpu_util", "device utilisation (%)", "gpu_util", hide_when_empty=True),
    ChartSpec("gpu_memory", "device memory used (MiB)", "gpu_memory", hide_when_empty=True),
)


def state():
    return current_app.extensions["dashboard"]


def page_data(run_name: str | None) -> dict:
    """Everything the page shows at first paint; app.js refreshes each part from the API."""
    registry, policy = state().registry, state().policy
    run = registry.get(run_name)
    return {
        "run": run.name,
        "runs": run_stats.runs(registry, policy),
        "stats": run_stats.stats(run, policy),
        "checkpoints": run_tables.checkpoints(run),
        "evals": run_tables.evals(run),
        "events": run_tables.events(run, None, 200, None),
        "errors": run_tables.errors(run),
        "gpu": devices.gpu(run, None, None, 0, False),
        "experts": {k: v for k, v in summaries.experts(run, "latest", None, None).items() if k != "matrix"},
    }


@bp.get("/")
def index():
    """The dashboard page for ``run=`` (default: the most recent run)."""
    interval = float_arg(request.args, "interval", current_app.config["DASHBOARD_POLL_SECONDS"], 0.5, 3600.0)
    try:
        initial = page_data(request.args.get("run"))
    except DashboardError as error:
        if error.status != 404 or request.args.get("run"):
            raise
        initial = None  # an empty log root: show the page, it fills once a run appears
    return render_template(
        "index.html",
        initial=initial,
        stats=initial["stats"] if initial else None,
        interval=interval,
        poll_choices=sorted({*POLL_CHOICES, interval}),
        charts=CHARTS,
        tabs=TABS,
        token=request.args.get("token") or "",
        log_root=current_app.config["DASHBOARD_LOG_ROOT"],
    )


@bp.app_context_processor
def asset_helper() -> dict:
    """``asset('app.js')``: a static URL that carries the token, since every route but /health needs it."""

    def asset(filename: str) -> str:
        token = request.args.get("token")
        return url_for("static", filename=filename, **({"token": token} if token else {}))

    return {"asset": asset}


def error_page(status: int, message: str):
    return render_template(
        "error.html", status=status, message=message, token=request.args.get("token") or ""
    ), status


@bp.app_template_filter("num")
def format_number(value, digits: int = 4) -> str:
    """The dashboard's one way to show a number; ``fmt`` in static/charts.js is the same rule, so the page
    reads the same before and after its scripts refresh it. From 1,000 up a whole number with thousands
    separators (counts and rates: 40,981 tokens/s, never 4.098e+04); below, ``digits`` significant digits
    (0.1235, 12.35); below 0.001, an exponent (learning rates: 3e-4, 2.5e-5); missing or not finite: "-"."""
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and abs(value) < 1e-3:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    rounded = float(f"{value:.{digits}g}")
    if abs(rounded) >= 1000:
        return f"{math.floor(value + 0.5):,}"  # halves round up, as JavaScript's Math.round does
    return f"{rounded:.{digits}g}"


@bp.app_template_filter("duration")
def format_duration(seconds) -> str:
    """As ``duration`` in static/app.js: 45 s, 12 min 5 s, 3 h 20 min, 2 days 4 h."""
    if seconds is None:
        return "-"
    return age_words(seconds)


@bp.app_template_filter("clock")
def format_clock(ts) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
