"""Wall time of the embedded default run (target: under 3 minutes on a 2-core CPU), beside its parts.

Runs `python -m trainer train` on training_config.yaml into a temporary folder and prints one table:
total wall time, time to the first logged step (start-up: imports, tiny model, data), training time,
and the share spent in evaluations and checkpoints, with the first and last losses.

    python bench/bench_default_run.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from trainer.runfolder import iter_records  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "default"
        started = time.time()
        result = harness.run_child(
            [sys.executable, "-m", "trainer", "train", "--set", f"paths.output_dir={out}"], cwd=REPO
        )
        wall = time.time() - started
        if result.returncode != 0:
            raise SystemExit(result.stderr[-2000:])
        steps = list(iter_records(out / "logs" / "training_log.jsonl"))
        events = list(iter_records(out / "logs" / "events.jsonl"))
        first_step_at = steps[0]["ts"] - started
        train_span = steps[-1]["ts"] - steps[0]["ts"]
        evals = sum(
            done["ts"] - start["ts"]
            for start, done in zip(
                [e for e in events if e["event"] == "eval_start"],
                [e for e in events if e["event"] == "eval_done"],
            )
        )
        print(f"{'measure':<34}{'value':>12}")
        print(f"{'total wall time (target < 180 s)':<34}{wall:>11.1f}s")
        print(f"{'start-up to first step':<34}{first_step_at:>11.1f}s")
        print(f"{'first to last step':<34}{train_span:>11.1f}s")
        print(f"{'of which evaluations':<34}{evals:>11.1f}s")
        print(f"{'steps':<34}{len(steps):>12}")
        print(
            f"{'loss: first 10 -> last 10 (mean)':<34}"
            f"{sum(r['loss'] for r in steps[:10]) / 10:>6.2f} ->{sum(r['loss'] for r in steps[-10:]) / 10:>5.2f}"
        )


if __name__ == "__main__":
    main()
