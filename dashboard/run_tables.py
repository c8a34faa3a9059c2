"""The page's tables and their API routes: evaluations, checkpoints, events, errors.

Each function takes a refreshed ``RunData`` and returns JSON-ready values, records as the trainer
wrote them; the page and the API call the same function, so they never disagree.
"""

from __future__ import annotations

from trainer.runfolder.columns import record_ts
from trainer.runfolder.rundata import RunData
from trainer.runfolder.summaries import best_eval, checkpoint_rows


def evals(run: RunData) -> dict:
    with run.lock:
        records = run.evals.records()
        return {"run": run.name, "count": len(records), "best": best_eval(run), "evals": records}


def events(run: RunData, kinds: set[str] | None, limit: int, since_ts: float | None) -> dict:
    """Events in file order (oldest first), the newest ``limit`` of those that match."""
    with run.lock:
        items = run.events.items
        counts: dict[str, int] = {}
        for item in items:
            counts[item["event"]] = counts.get(item["event"], 0) + 1
        chosen = [
            e
            for e in items
            if (kinds is None or e["event"] in kinds)
            and (since_ts is None or (record_ts(e) or 0.0) > since_ts)
        ]
        return {
            "run": run.name,
            "total": len(items),
            "matched": len(chosen),
            "counts": counts,
            "events": chosen[-limit:],
        }


def errors(run: RunData) -> dict:
    with run.lock:
        return {
            "run": run.name,
            "count": len(run.errors.items),
            "errors": list(run.errors.items),
            "bad_lines": run.bad_lines(),
        }


def checkpoints(run: RunData) -> dict:
    with run.lock:
        rows = checkpoint_rows(run)
        best = next((r["name"] for r in rows if r["best"]), None)
        return {
            "run": run.name,
            "checkpoints": rows,
            "best": best,
            "on_disk": sum(r["on_disk"] for r in rows),
            "pruned": sum(r["pruned"] for r in rows),
        }


def latest_checkpoint(run: RunData) -> dict | None:
    rows = [r for r in checkpoint_rows(run) if r["step"] is not None]
    if not rows:
        return None
    last = max(rows, key=lambda r: (r["step"], r["ts"] or 0.0))
    return {k: last[k] for k in ("name", "step", "ts", "on_disk", "best")}
