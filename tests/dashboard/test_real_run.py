"""The dashboard over a run folder written by the real trainer (``trained_run``, from conftest).

Every number is checked against the logs themselves, read with the contract's reference reader
(``runfolder.iter_records`` + ``runfolder.last_per_step``), so a change on either side shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard import create_app
from trainer import runfolder
from trainer.runfolder.plots import PLOT_NAMES

# Every test reads the run folder of one real training run (the session's trained_run).
pytestmark = pytest.mark.slow


def log(run: Path, name: str) -> list[dict]:
    return list(runfolder.iter_records(run / runfolder.LOGS_DIR / name))


@pytest.fixture(scope="module")
def real(trained_run: Path):
    """A client over the trained run's parent folder (a log root holding the run)."""
    return create_app(trained_run.parent, {"TESTING": True}).test_client()


def ok(client, url: str):
    response = client.get(url)
    assert response.status_code == 200, (url, response.get_data(as_text=True)[:500])
    return response.get_json() if response.is_json else response


def test_run_is_listed_and_finished(real, trained_run: Path):
    runs = ok(real, "/api/runs")
    assert runs["latest"] == trained_run.name
    entry = next(r for r in runs["runs"] if r["name"] == trained_run.name)
    assert entry["status"] == runfolder.read_run_json(trained_run)["status"] == "finished"


def test_stats_match_the_logs(real, trained_run: Path):
    train = runfolder.last_per_step(log(trained_run, runfolder.TRAINING_LOG))
    stats = ok(real, f"/api/stats?run={trained_run.name}")
    assert stats["step"] == train[-1]["step"] == runfolder.read_run_json(trained_run)["step"]
    assert stats["total_steps"] == train[-1]["total_steps"] and stats["progress"] == 1.0
    assert stats["loss"] == pytest.approx(train[-1]["loss"])
    assert stats["lr"] == pytest.approx(train[-1]["lr"])
    assert stats["tokens_per_sec"] == pytest.approx(train[-1]["tokens_per_sec"])
    assert stats["error_count"] == len(log(trained_run, runfolder.ERROR_LOG)) == 0
    assert stats["bad_lines"] == {}
    evals = log(trained_run, runfolder.EVAL_LOG)
    best = [e for e in evals if e.get("is_best")][-1]
    assert stats["best_eval"]["step"] == best["step"] and stats["best_eval"]["eval_loss"] == pytest.approx(
        best["eval_loss"]
    )
    assert stats["last_checkpoint"]["step"] == max(
        runfolder.checkpoint_step(p.name) or 0 for p in trained_run.iterdir()
    )


def test_metrics_are_the_training_log(real, trained_run: Path):
    train = runfolder.last_per_step(log(trained_run, runfolder.TRAINING_LOG))
    series = ok(real, f"/api/metrics?run={trained_run.name}&field=loss,lr,grad_norm&max_points=0")["series"]
    for field in ("loss", "lr", "grad_norm"):
        assert [p[1] for p in series[field]["points"]] == [r["step"] for r in train]
        assert [p[2] for p in series[field]["points"]] == pytest.approx([r[field] for r in train])
    csv = ok(real, f"/api/metrics?run={trained_run.name}&format=csv&max_points=0").get_data(as_text=True)
    assert len(csv.strip().splitlines()) == len(train) + 1


def test_evals(real, trained_run: Path):
    evals = ok(real, f"/api/evals?run={trained_run.name}")
    assert [e["step"] for e in evals["evals"]] == [
        e["step"] for e in runfolder.last_per_step(log(trained_run, runfolder.EVAL_LOG))
    ]


def test_checkpoints_match_disk_and_events(real, trained_run: Path):
    table = ok(real, f"/api/checkpoints?run={trained_run.name}")
    on_disk = {
        p.name for p in trained_run.iterdir() if p.is_dir() and runfolder.checkpoint_step(p.name) is not None
    }
    assert {r["name"] for r in table["checkpoints"] if r["on_disk"]} == on_disk
    events = log(trained_run, runfolder.EVENTS_LOG)
    saved = {Path(e["path"]).name for e in events if e["event"] == "checkpoint_saved"}
    assert saved <= {r["name"] for r in table["checkpoints"]}
    pruned_rows = {r["name"] for r in table["checkpoints"] if r["pruned"]}
    assert pruned_rows == {r["name"] for r in table["checkpoints"] if not r["on_disk"]}
    assert {
        Path(e["path"]).name for e in events if e["event"] == "checkpoint_pruned"
    } - on_disk <= pruned_rows
    best_rows = [r for r in table["checkpoints"] if r["best"]]
    best_event = [e for e in events if e["event"] == "best_updated"][-1]
    assert best_rows and all(r["step"] == best_event["step"] for r in best_rows)
    sizes = {Path(e["path"]).name: e["size_bytes"] for e in events if e["event"] == "checkpoint_saved"}
    assert all(r["size_bytes"] == sizes[r["name"]] for r in table["checkpoints"] if r["name"] in sizes)


def test_events_include_the_lifecycle(real, trained_run: Path):
    counts = ok(real, f"/api/events?run={trained_run.name}")["counts"]
    for event in ("run_start", "checkpoint_saved", "best_updated", "run_end"):
        assert counts.get(event, 0) >= 1, event


def test_expert_usage_matches_the_log(real, trained_run: Path):
    windows = runfolder.last_per_step(log(trained_run, runfolder.EXPERT_LOG))
    assert windows, "the default run is a mixture-of-experts model: it must log expert usage"
    latest = ok(real, f"/api/experts?run={trained_run.name}")
    assert [layer["counts"] for layer in latest["layers"]] == [
        layer["counts"] for layer in windows[-1]["layers"]
    ]
    assert latest["num_experts"] == windows[-1]["num_experts"]
    assert all(len(row) == windows[-1]["num_experts"] for row in latest["matrix"])
    everything = ok(real, f"/api/experts?run={trained_run.name}&window=all")
    assert everything["windows"] == len(windows)
    assert everything["layers"][0]["counts"] == [
        sum(c) for c in zip(*(w["layers"][0]["counts"] for w in windows))
    ]


def test_gpu_telemetry(real, trained_run: Path):
    samples = log(trained_run, runfolder.GPU_LOG)
    result = ok(real, f"/api/gpu?run={trained_run.name}")
    assert {(d["host"], d["device"]) for d in result["devices"]} == {
        (s["host"], s["device"]) for s in samples
    }


@pytest.mark.parametrize("name", PLOT_NAMES)
def test_plots_render(real, trained_run: Path, name: str):
    response = ok(real, f"/api/plots/{name}.png?run={trained_run.name}")
    assert response.mimetype == "image/png" and response.data.startswith(b"\x89PNG")


def test_page_and_prometheus(real, trained_run: Path):
    step = runfolder.last_per_step(log(trained_run, runfolder.TRAINING_LOG))[-1]["step"]
    html = ok(real, f"/?run={trained_run.name}").get_data(as_text=True)
    assert f'<strong data-stat="step">{step:,}</strong>' in html
    text = ok(real, f"/metrics?run={trained_run.name}").get_data(as_text=True)
    assert f'finetune_step{{run="{trained_run.name}"}} {step}' in text


def test_the_run_folder_itself_as_log_root(trained_run: Path):
    client = create_app(trained_run).test_client()
    assert ok(client, "/api/stats")["run"] == trained_run.name


def test_serving_does_not_touch_the_run(real, trained_run: Path):
    def snapshot():
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in trained_run.rglob("*")}

    before = snapshot()
    for url in ("/", "/api/stats", "/api/checkpoints", "/api/plots/loss.png", "/api/experts", "/metrics"):
        ok(real, f"{url}{'&' if '?' in url else '?'}run={trained_run.name}")
    assert snapshot() == before
