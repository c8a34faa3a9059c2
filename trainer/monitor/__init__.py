"""What watches a run while it trains, beside the loop, never in its way.

- ``telemetry``: background GPU/CPU/RAM sampler (NVML, psutil), one writer per node.
- ``experts``: forward hooks that count which experts MoE routers pick.
- ``notify`` and ``notify_email``: webhook and e-mail notifications, and the stall watchdog.
"""
