"""The JSON API (and /health, /metrics, the plot PNGs): thin routes over the data functions the page
also calls (``run_stats``, ``log_series``, ``run_tables``, ``devices``, ``config_diff``).

Every route about one run takes ``run=`` (default: the most recent run; /health and /api/runs take none).
Bad parameters answer 400, an unknown run or plot 404, always as JSON ``{"error", "status"}`` (see ``errors``).
"""

from __future__ import annotations

import hashlib
import re

from flask import Blueprint, Response, current_app, jsonify, make_response, request

from trainer.runfolder import plots, summaries
from trainer.runfolder.plots import PLOT_NAMES, PLOT_SOURCES, PlotOptions
from trainer.runfolder.series import SMOOTHING_MODES

from . import config_diff, devices, log_series, prometheus, run_stats, run_tables
from .errors import DashboardError, bool_arg, choice_arg, float_arg, int_arg

bp = Blueprint("api", __name__)

MAX_FIELDS = 32
EVENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def state():
    return current_app.extensions["dashboard"]


def current_run(param: str = "run"):
    return state().registry.get(request.args.get(param))


def list_arg(name: str) -> list[str]:
    """Repeated and/or comma-separated values: ``?field=loss&field=lr`` or ``?field=loss,lr``."""
    values = [v.strip() for raw in request.args.getlist(name) for v in raw.split(",") if v.strip()]
    if len(values) > MAX_FIELDS:
        raise DashboardError(400, f"at most {MAX_FIELDS} values for {name!r}, got {len(values)}")
    return values


def max_points_arg(default: int) -> int:
    value = int_arg(request.args, "max_points", default, 0, 1_000_000)
    if value == 1:
        raise DashboardError(
            400, "parameter 'max_points' must be 0 (all points) or at least 2 (first and last are kept)"
        )
    return value


@bp.get("/health")
def health():
    """Liveness for load balancers and scripts; needs no token and reads no run."""
    return jsonify(status="ok")


@bp.get("/api/runs")
def runs():
    return jsonify(run_stats.runs(state().registry, state().policy))


@bp.get("/api/stats")
def stats():
    return jsonify(run_stats.stats(current_run(), state().policy))


@bp.get("/api/metrics")
def metrics():
    log = choice_arg(request.args, "log", ("train", "eval"), "train")
    fields = list_arg("field") or (["loss"] if log == "train" else ["eval_loss"])
    since_step = int_arg(request.args, "since_step", 0, 0)
    max_points = max_points_arg(1000)
    fmt = choice_arg(request.args, "format", ("json", "csv"), "json")
    result = log_series.metrics(current_run(), fields, log, since_step, max_points)
    if fmt == "csv":
        return Response(log_series.metrics_csv(result), mimetype="text/csv")
    return jsonify(result)


@bp.get("/api/series")
def series():
    """Chart-ready columns (``step``, ``wall``, ``tokens_seen``, one list per field) from ``since_step``."""
    log = choice_arg(request.args, "log", ("train", "eval"), "train")
    fields = list_arg("field") or (["loss"] if log == "train" else ["eval_loss"])
    since_step = int_arg(request.args, "since_step", 0, 0)
    max_points = max_points_arg(4000)
    return jsonify(log_series.series(current_run(), fields, log, since_step, max_points))


@bp.get("/api/config")
def config():
    """The saved config of ``run`` (repeat or comma-separate for several: only differing keys, unless ``all=1``)."""
    names = list_arg("run")
    return jsonify(config_diff.config_view(state().registry, names, bool_arg(request.args, "all")))


@bp.get("/api/evals")
def evals():
    return jsonify(run_tables.evals(current_run()))


@bp.get("/api/checkpoints")
def checkpoints():
    return jsonify(run_tables.checkpoints(current_run()))


@bp.get("/api/events")
def events():
    kinds = list_arg("event")
    bad = [k for k in kinds if not EVENT_NAME.match(k)]
    if bad:
        raise DashboardError(
            400, f"parameter 'event' must be event names like 'checkpoint_saved', got {bad[0]!r}"
        )
    limit = int_arg(request.args, "limit", 1000, 1, 100_000)
    since_ts = float_arg(request.args, "since_ts", None, 0.0, 1e12)
    return jsonify(run_tables.events(current_run(), set(kinds) or None, limit, since_ts))


@bp.get("/api/errors")
def errors():
    return jsonify(run_tables.errors(current_run()))


@bp.get("/api/gpu")
def gpu():
    fields = list_arg("field") or None
    since_ts = float_arg(request.args, "since_ts", None, 0.0, 1e12)
    max_points = max_points_arg(500)
    with_series = bool_arg(request.args, "series", True)
    result = devices.gpu(current_run(), fields, since_ts, max_points, with_series)
    if choice_arg(request.args, "format", ("json", "csv"), "json") == "csv":
        return Response(devices.gpu_csv(result), mimetype="text/csv")
    return jsonify(result)


def expert_window() -> tuple[str, int | None, int | None]:
    from_step = int_arg(request.args, "from_step", None, 0)
    to_step = int_arg(request.args, "to_step", None, 0)
    ranged = from_step is not None or to_step is not None
    window = choice_arg(request.args, "window", ("latest", "all", "range"), "range" if ranged else "latest")
    if from_step is not None and to_step is not None and from_step > to_step:
        raise DashboardError(400, f"from_step ({from_step}) must not be greater than to_step ({to_step})")
    return window, from_step, to_step


@bp.get("/api/experts")
def experts():
    return jsonify(summaries.experts(current_run(), *expert_window()))


@bp.get("/metrics")
def prometheus_metrics():
    """Prometheus text format; ``?all=1`` exposes every run under the root, not just one."""
    registry, policy = state().registry, state().policy
    chosen = (
        [registry.get(name) for name in registry.runs()] if bool_arg(request.args, "all") else [current_run()]
    )
    entries = [
        {"stats": run_stats.stats(run, policy), "gpu": devices.gpu(run, None, None, 0, False)}
        for run in chosen
    ]
    return Response(prometheus.exposition(entries), mimetype="text/plain; version=0.0.4")


# ---------------------------------------------------------------- plots


def plot_options(name: str) -> PlotOptions:
    """Options from the query: smoothing, weight (EMA), ma_window, log, since_step; experts' window."""
    window, from_step, to_step = expert_window() if name == "experts" else ("latest", None, None)
    return PlotOptions(
        smoothing=choice_arg(request.args, "smoothing", SMOOTHING_MODES, "ema"),
        weight=float_arg(request.args, "weight", 0.6, 0.0, 0.999),
        window=int_arg(request.args, "ma_window", 10, 1, 100_000),
        log_y=bool_arg(request.args, "log"),
        since_step=int_arg(request.args, "since_step", 0, 0),
        expert_window=window,
        from_step=from_step,
        to_step=to_step,
    )


@bp.get("/api/plots/<name>.png")
def plot(name: str):
    if name not in PLOT_NAMES:
        raise DashboardError(404, f"unknown plot {name!r}; plots: {', '.join(PLOT_NAMES)}")
    options = plot_options(name)
    run = current_run()
    compare = current_run("compare") if name == "loss" and request.args.get("compare") else None
    sources = PLOT_SOURCES[name]
    key = (
        run.name,
        name,
        options,
        tuple(run.versions()[s] for s in sources),
        (compare.name, compare.train.version) if compare else None,
    )
    png = state().plot_cache.get_or_render(key, lambda: plots.render(name, run, options, compare))
    response = make_response(png)
    response.mimetype = "image/png"
    response.set_etag(hashlib.sha1(repr(key).encode()).hexdigest())
    response.headers["Cache-Control"] = "no-cache"
    return response.make_conditional(request)
