"""Finding things under a log root: run folders, the sweeps that list them, and sizes on disk.

The dashboard, ``list``, ``aggregate`` and the sweep all walk folders through here, so they
agree on what counts as a run and which sweep a run belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from trainer.runfolder.layout import BEST_ADAPTER_DIR, LOGS_DIR, SWEEP_JSON, checkpoint_step, is_run_folder
from trainer.runfolder.reader import read_json_object

MAX_DEPTH = 4
RUN_SKIP_DIRS = (LOGS_DIR, BEST_ADAPTER_DIR, "__pycache__", "node_modules")
SWEEP_DEPTH = 2  # sweep.json files are looked for in the root and up to this many folders down


def find_run_folders(
    root: Path, max_depth: int = MAX_DEPTH, keep: Callable[[Path], bool] | None = None
) -> dict[str, Path]:
    """Run folders under ``root`` by name (path relative to root, '/'-separated), at most ``max_depth`` down.

    The root itself may be a run: it is then the only one, named after its folder. Hidden folders,
    checkpoints and logs are not entered; a folder reached twice (symlinks) counts once; ``keep(path)``
    may refuse a folder (the dashboard refuses links that leave its root).
    """
    root = Path(root)
    if is_run_folder(root):
        return {root.name or "run": root}
    found: dict[str, Path] = {}
    seen = {os.path.realpath(root)}

    def walk(folder: Path, rel: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name in RUN_SKIP_DIRS or checkpoint_step(name) is not None:
                continue
            try:
                if not entry.is_dir():
                    continue
            except OSError:
                continue
            path = Path(entry.path)
            real = os.path.realpath(path)
            if real in seen or (keep is not None and not keep(path)):
                continue
            seen.add(real)
            child = f"{rel}/{name}" if rel else name
            if is_run_folder(path):
                found[child] = path
            elif depth < max_depth:
                walk(path, child, depth + 1)

    walk(root, "", 1)
    return found


def find_sweeps(root: Path, confine: bool = False) -> list[tuple[Path, dict]]:
    """``(path, summary)`` of every readable sweep.json under ``root`` that lists jobs.

    ``confine``: refuse files that resolve outside the root (the dashboard's promise).
    """
    root = Path(root)
    patterns = [SWEEP_JSON] + ["/".join(["*"] * depth + [SWEEP_JSON]) for depth in range(1, SWEEP_DEPTH + 1)]
    found = []
    for path in [p for pattern in patterns for p in sorted(root.glob(pattern))]:
        summary = read_json_object(path, root if confine else None, max_bytes=None)
        if isinstance(summary.get("jobs"), list):
            found.append((path, summary))
    return found


def sweep_name(path: Path, summary: dict) -> str:
    """The sweep's name as sweep.json gives it, else its folder's."""
    return str(summary.get("sweep") or path.parent.name)


def sweep_jobs(sweeps: list[tuple[Path, dict]]) -> dict[str, dict]:
    """Every job of the given sweeps by its resolved output folder, with its sweep's name as ``sweep``."""
    jobs: dict[str, dict] = {}
    for path, summary in sweeps:
        for job in summary["jobs"]:
            if isinstance(job, dict) and isinstance(job.get("output_dir"), str):
                jobs[os.path.realpath(job["output_dir"])] = {**job, "sweep": sweep_name(path, summary)}
    return jobs


def folder_size(path: Path) -> int:
    """Bytes of the files below ``path``; links are not followed and files vanishing mid-walk
    (a checkpoint pruned while we count) are skipped."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            file_path = os.path.join(folder, name)
            if os.path.islink(file_path):
                continue
            try:
                total += os.stat(file_path).st_size
            except OSError:
                pass
    return total
