"""One run folder, one best evaluation: the loop, the dashboard's run page and runs overview, ``list``,
``aggregate`` and the end-of-run report all name the same step.

The run below is MRPC ranked by accuracy (``eval.metric_for_best: accuracy``), so the task's official
metric (F1), the lowest eval loss and a stale ``is_best`` flag each point elsewhere:
step 2 has the lowest eval loss, step 4 the highest F1, step 6 the highest accuracy (the best), and
step 8 carries ``is_best: true`` written out of step (as a resumed run that lost its best could).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from dashboard import create_app
from trainer import runfolder
from trainer.reports.aggregate import aggregate
from trainer.reports.report import summarize
from trainer.reports.runinfo import best_metric

BEST_STEP = 6
EVALS = [
    # step, eval_loss, f1, accuracy, is_best
    (2, 0.50, 0.70, 0.60, True),
    (4, 0.90, 0.90, 0.65, True),
    (6, 0.80, 0.80, 0.80, True),
    (8, 0.85, 0.75, 0.70, True),
]


def write_run(run_dir, stamped: bool) -> None:
    """A run folder as the trainer writes it; ``stamped=False``: as written before eval records named their metric."""
    (run_dir).mkdir(parents=True)
    config = {"eval": {"task": "mrpc", "metric_for_best": "accuracy", "greater_is_better": True}}
    (run_dir / runfolder.CONFIG_YAML).write_text(yaml.safe_dump(config))
    log = runfolder.RunLog(run_dir)
    log.update_run(run_id="agree", status="finished", started_at=1.0, total_steps=8, step=8)
    for step, loss, f1, accuracy, is_best in EVALS:
        record = {
            "step": step,
            "eval_loss": loss,
            "perplexity": 2.0,
            "eval_tokens": 10,
            "task": "mrpc",
            "metrics": {"f1": f1, "accuracy": accuracy},
            "is_best": is_best,
        }
        if stamped:
            record.update(metric_for_best="accuracy", greater_is_better=True)
        log.write(runfolder.EVAL_LOG, record)
        log.event("checkpoint_saved", step=step, path=str(run_dir / f"checkpoint-{step}"), metric="accuracy",
                  metric_value=accuracy, kind="periodic")  # fmt: skip
        if step == BEST_STEP:
            log.event(
                "best_updated", step=step, metric="accuracy", metric_value=accuracy, path="best-adapter"
            )
    log.close()


def loop_best_step(run_dir) -> int | None:
    """The step the training loop's own rule (``best_is``) keeps as best, fed the records in order."""
    from trainer.training.evaluation import best_is, metric_value

    cfg = SimpleNamespace(eval=SimpleNamespace(metric_for_best="accuracy", greater_is_better=True))
    best, best_step = None, None
    for record in runfolder.last_per_step(
        list(runfolder.iter_records(run_dir / "logs" / runfolder.EVAL_LOG))
    ):
        value = metric_value(record, cfg)
        if best_is(value, best, cfg):
            best, best_step = value, record["step"]
    return best_step


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped", "older-folder"])
def test_every_reader_names_the_same_best_evaluation(tmp_path, stamped):
    root = tmp_path / "runs"
    run_dir = root / "mrpc-acc"
    write_run(run_dir, stamped)
    client = create_app(root, {"TESTING": True}).test_client()

    stats = json.loads(client.get("/api/stats?run=mrpc-acc").data)
    evals = json.loads(client.get("/api/evals?run=mrpc-acc").data)
    overview = json.loads(client.get("/api/overview").data)
    found = {
        "loop": loop_best_step(run_dir),
        "run page": stats["best_eval"]["step"],
        "evals api": evals["best"]["step"],
        "runs overview": overview["runs"][0]["best"]["step"],
        "list": best_metric(run_dir)["step"],
        "aggregate": aggregate(root)["runs"][0]["best_step"],
        "report": summarize(run_dir)["best_eval"][0],
    }
    assert found == dict.fromkeys(found, BEST_STEP)
    assert overview["runs"][0]["best"]["metric"] == "accuracy" and overview["runs"][0]["best"]["value"] == 0.8
    assert aggregate(root)["runs"][0]["metrics"] == {
        "f1": 0.80,
        "accuracy": 0.80,
    }  # official metrics, read at it
