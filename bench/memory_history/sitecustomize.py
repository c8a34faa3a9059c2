"""Records every CUDA allocation of a trainer process, with its Python stack, and dumps the allocator's snapshot
at exit, for ``bench/memory_peak.py`` to say what was live at the peak.

    PYTHONPATH=bench/memory_history:$PYTHONPATH MEMORY_HISTORY_DIR=/tmp/mh python -m trainer train --config ...

Only processes whose command line names ``trainer`` record (pip, the bench's parent and its other children do
not): each writes ``$MEMORY_HISTORY_DIR/<its config's folder>-<config name>-<pid>.pickle``. Recording slows the host, so tokens/s from such a run
mean nothing.
"""

import atexit
import os
import sys

_folder = os.environ.get("MEMORY_HISTORY_DIR")
if _folder and "trainer" in getattr(sys, "orig_argv", sys.argv):
    import torch

    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(
            context="alloc",
            stacks="python",
            max_entries=int(os.environ.get("MEMORY_HISTORY_ENTRIES", 3_000_000)),
        )

        def _name() -> str:
            argv = list(getattr(sys, "orig_argv", sys.argv))
            config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else ""
            parts = os.path.normpath(config).split(os.sep)[-2:] if config else []
            return "-".join([*(os.path.splitext(part)[0] for part in parts), str(os.getpid())])

        def _dump() -> None:
            os.makedirs(_folder, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(_folder, f"{_name()}.pickle"))

        atexit.register(_dump)
