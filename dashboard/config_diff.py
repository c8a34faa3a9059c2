"""The config tab and ``/api/config``: one run's saved config, or what differs between several."""

from __future__ import annotations

from trainer.runfolder import runconfig

from .runs import RunRegistry


def config_view(registry: RunRegistry, names: list[str], everything: bool) -> dict:
    """The saved config of one run (every key), or of several (only the keys that differ, unless
    ``everything``): ``keys`` and per key the value in each run, in the order the runs were given."""
    chosen = [registry.get(name) for name in names] if names else [registry.get(None)]
    configs = [runconfig.read_config(run.path, registry.root) for run in chosen]
    if len(configs) == 1 or everything:
        keys = sorted(set().union(*configs))
    else:
        keys = runconfig.differing(configs)
    return {
        "runs": [run.name for run in chosen],
        "found": [bool(c) for c in configs],
        "keys": keys,
        "values": {k: [c.get(k) for c in configs] for k in keys},
        "total_keys": len(set().union(*configs)),
    }
