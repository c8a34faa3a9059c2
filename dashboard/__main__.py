"""``python -m dashboard``: print where to open the dashboard, then serve it (gunicorn if present).

launch_dashboard.sh picks a Python with the dashboard's light requirements and runs this.
One gunicorn worker with threads: every request shares one in-memory reader per run, so a
million-line log is parsed once, not once per worker. The server runs at a lower CPU priority
than training (``--nice``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


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
    return command + ["dashboard:create_app()"]


def use_gunicorn(choice: str) -> bool:
    available = importlib.util.find_spec("gunicorn") is not None and os.name == "posix"
    if choice == "gunicorn" and not available:
        raise SystemExit("gunicorn is not installed here: pip install gunicorn, or use --server flask")
    return available and choice != "flask"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    token = os.environ.get("DASHBOARD_TOKEN") or None
    os.environ["DASHBOARD_LOGDIR"] = str(Path(args.logdir).resolve())
    for line in banner(args, token):
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)
    gunicorn = use_gunicorn(args.server)
    if args.dry_run:
        print("server:", " ".join(gunicorn_command(args)) if gunicorn else "flask (threaded)")
        return
    if args.nice:
        try:
            os.nice(args.nice)
        except (AttributeError, OSError):
            pass
    if gunicorn:
        command = gunicorn_command(args)
        os.execv(command[0], command)
    from . import create_app

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # request lines would print ?token=
    create_app().run(host=args.host, port=args.port, threaded=True, debug=False, use_reloader=False)


if __name__ == "__main__":
    main()
