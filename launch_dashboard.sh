#!/usr/bin/env bash
# Start the read-only training dashboard (Flask app under gunicorn, else Flask's own server).
#   ./launch_dashboard.sh [--logdir runs] [--host 127.0.0.1] [--port 5000] [--server auto|gunicorn|flask]
# Binds to this machine only by default; from a laptop use an SSH tunnel (docs/dashboard.md).
# Set DASHBOARD_TOKEN before binding to another address. Uses .venv when it has flask and
# matplotlib, else creates .venv-dashboard with only the dashboard's requirements (no torch).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
has_requirements() { "$1" -c 'import flask, matplotlib' >/dev/null 2>&1; }

python=""
for candidate in "${DASHBOARD_PYTHON:-}" "$repo/.venv/bin/python" "$repo/.venv-dashboard/bin/python"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && has_requirements "$candidate"; then
    python="$candidate"
    break
  fi
done

if [ -z "$python" ]; then
  echo "Installing the dashboard's requirements (flask, gunicorn, matplotlib) into $repo/.venv-dashboard ..." >&2
  base_python="$(command -v python3 || command -v python)" || { echo "python3 not found" >&2; exit 1; }
  "$base_python" -m venv "$repo/.venv-dashboard"
  "$repo/.venv-dashboard/bin/python" -m pip install --quiet --upgrade pip
  "$repo/.venv-dashboard/bin/python" -m pip install --quiet -e "$repo[dashboard]"
  python="$repo/.venv-dashboard/bin/python"
fi

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m dashboard "$@"
