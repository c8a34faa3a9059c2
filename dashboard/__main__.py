"""``python -m dashboard``: serve the dashboard (gunicorn if present) and say where to open it once it answers.

launch_dashboard.sh picks a Python with the dashboard's light requirements and runs this.
One gunicorn worker with threads: every request shares one in-memory reader per run, so a
million-line log is parsed once, not once per worker. The server runs at a lower CPU priority
than training (``--nice``).

The URLs are printed only once the server serves: gunicorn's ``post_worker_init`` hook
(dashboard/gunicorn_hooks.py) prints them after its worker has loaded the app; Flask's server
prints them after binding. A port already taken is one line and exit 2, before anything starts.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
EXIT_PORT_IN_USE = 2  # bad input: the --port chosen
BANNER_ENV = "DASHBOARD_BANNER"  # the lines gunicorn's hook prints once the worker is ready


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch_dashboard.sh", description="Read-only dashboard over run folders."
    )
    parser.add_argument(
        "--logdir",
        default=os.environ.get("DASHBOARD_LOGDIR", "runs"),
        help="log root: a run folder, or a folder holding runs (default: $DASHBOARD_LOGDIR or ./runs)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    parser.add_argument(
        "--server",
        choices=("auto", "gunicorn", "flask"),
        default="auto",
        help="gunicorn when installed (auto), or Flask's own threaded server",
    )
    parser.add_argument("--threads", type=int, default=4, help="request threads (default 4)")
    parser.add_argument(
        "--nice", type=int, default=10, help="CPU priority increment, so training comes first (default 10)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the URLs and the command, then exit")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    return args


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def lan_address() -> str | None:
    """This machine's address on its default route (no packet is sent), else its host name's."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
            if not address.startswith("127."):
                return address
    except OSError:
        pass
    try:
        address = socket.gethostbyname(socket.gethostname())
        return None if address.startswith("127.") else address
    except OSError:
        return None


def banner(args: argparse.Namespace, token: str | None) -> list[str]:
    """The lines printed at start: local and LAN URLs, the SSH tunnel, and any warning."""
    suffix = f"/?token={token}" if token else "/"
    root = Path(args.logdir).resolve()
    lines = [f"Dashboard (read-only) for {root}"]
    if not root.exists():
        lines.append(f"  note: {root} does not exist yet; runs appear once the trainer creates them")
    local = "127.0.0.1" if is_loopback(args.host) or args.host in ("0.0.0.0", "::") else args.host
    lines.append(f"  local:  http://{local}:{args.port}{suffix}")
    lan = lan_address() if args.host in ("0.0.0.0", "::") else (None if is_loopback(args.host) else args.host)
    if lan:
        lines.append(f"  LAN:    http://{lan}:{args.port}{suffix}")
    else:
        other = lan_address()
        where = f"http://{other}:{args.port}/ " if other else ""
        lines.append(
            f"  LAN:    {where}(not served: bound to {args.host}; use --host 0.0.0.0 with DASHBOARD_TOKEN set)"
        )
    lines.append(
        f"  remote: ssh -N -L {args.port}:localhost:{args.port} <you>@<this host>, then open http://localhost:{args.port}{suffix}"
    )
    auth = '-H "Authorization: Bearer $DASHBOARD_TOKEN" ' if token else ""
    lines.append(f"  API:    curl {auth}http://{local}:{args.port}/api/stats")
    if not is_loopback(args.host) and not token:
        lines.append(
            f"WARNING: listening on {args.host} without DASHBOARD_TOKEN: anyone who can reach this port can read "
            "your runs (losses, configs, tracebacks). Set DASHBOARD_TOKEN=<secret> or bind to 127.0.0.1 and use an SSH tunnel."
        )
    return lines


def gunicorn_major() -> int:
    try:
        return int(importlib.metadata.version("gunicorn").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0


def gunicorn_command(args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers",
        "1",
        "--threads",
        str(args.threads),
        "--worker-class",
        "gthread",
        "--bind",
        f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}",
        "--timeout",
        "120",
        "--graceful-timeout",
        "5",
    ]
    if gunicorn_major() >= 25:
        command.append("--no-control-socket")  # gunicorn 25+ would otherwise create ~/.gunicorn/gunicorn.ctl
    command += ["--config", "python:dashboard.gunicorn_hooks"]  # prints the URLs once the worker is up
    return command + ["dashboard:create_app()"]


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (in use, no such address), else None; the socket is closed again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn and werkzeug bind
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use (another dashboard?); choose another with --port"
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def print_banner(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)


def use_gunicorn(choice: str) -> bool:
    available = importlib.util.find_spec("gunicorn") is not None and os.name == "posix"
    if choice == "gunicorn" and not available:
        raise SystemExit("gunicorn is not installed here: pip install gunicorn, or use --server flask")
    return available and choice != "flask"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    token = os.environ.get("DASHBOARD_TOKEN") or None
    os.environ["DASHBOARD_LOGDIR"] = str(Path(args.logdir).resolve())
    lines = banner(args, token)
    gunicorn = use_gunicorn(args.server)
    if args.dry_run:
        print_banner(lines)
        print("server:", " ".join(gunicorn_command(args)) if gunicorn else "flask (threaded)")
        return
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"launch_dashboard.sh: error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_PORT_IN_USE)
    if args.nice:
        try:
            os.nice(args.nice)
        except (AttributeError, OSError):
            pass
    if gunicorn:
        os.environ[BANNER_ENV] = "\n".join(lines)
        command = gunicorn_command(args)
        os.execv(command[0], command)
    from werkzeug.serving import make_server

    from . import create_app

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # request lines would print ?token=
    server = make_server(args.host, args.port, create_app(), threaded=True)  # binds here
    print_banner(lines)
    server.serve_forever()


if __name__ == "__main__":
    main()
