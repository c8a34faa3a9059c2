"""gunicorn settings module (``--config python:dashboard.gunicorn_hooks``): print the URLs once serving.

gunicorn binds first and loads the app in its worker afterwards; printing the URLs before that sent
users to a page that did not answer yet. The first worker prints the banner that ``python -m
dashboard`` left in $DASHBOARD_BANNER, right after it has loaded the app.
"""

from __future__ import annotations

import os
import sys


def post_worker_init(worker) -> None:
    if worker.age != 1:  # a restarted worker: the URLs were printed already
        return
    for line in os.environ.get("DASHBOARD_BANNER", "").splitlines():
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout, flush=True)
