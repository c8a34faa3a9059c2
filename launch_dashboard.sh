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

# A training venv made before gunicorn joined the train extra: add it (small, pure Python), so the
# dashboard is served by gunicorn whichever venv was picked; offline, Flask's server still serves.
if ! "$python" -c 'import gunicorn' >/dev/null 2>&1 && [ "${DASHBOARD_SERVER_INSTALL:-1}" = 1 ]; then
  echo "Adding gunicorn to $("$python" -c 'import sys; print(sys.prefix)') to serve the dashboard ..." >&2
  "$python" -m pip install --quiet "gunicorn>=22" >&2 || echo "could not install gunicorn; serving with Flask's server" >&2
fi

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m dashboard "$@"
