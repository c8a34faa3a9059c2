"""The JSON API against hand-made run folders: values, odd logs, bad parameters, error shapes."""

from __future__ import annotations

import csv
import io
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dashboard import create_app
from dashboard.runs import age_words
from tests.dashboard.fixtures import DEMO, LAST_STEP, NAN_STEP, TOTAL_STEPS, append, demo_loss, train_record
from trainer import runfolder

ENDPOINTS = (
    "/api/stats",
    "/api/metrics",
    "/api/evals",
    "/api/checkpoints",
    "/api/events",
    "/api/errors",
    "/api/gpu",
    "/api/experts",
    "/metrics",
)


def get(client, url: str, status: int = 200):
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code, response.get_data(as_text=True)[:500])
    return response.get_json() if response.is_json else response.get_data(as_text=True)


def test_health_and_runs(client):
    assert get(client, "/health") == {"status": "ok"}
    listing = get(client, "/api/runs")
    names = [r["name"] for r in listing["runs"]]
    assert listing["latest"] == DEMO == names[0]
    assert set(names) == {DEMO, "failed", "bare", "empty", "junk", "sweep/lr-1e-4"}
    status = {r["name"]: r["status"] for r in listing["runs"]}
    assert status[DEMO] == "running" and status["failed"] == "failed" and status["bare"] == "stalled"
    demo = listing["runs"][0]
    assert (demo["step"], demo["total_steps"]) == (LAST_STEP, TOTAL_STEPS)


def test_stats_of_the_demo_run(client):
    stats = get(client, "/api/stats")
    assert stats["run"] == DEMO and stats["status"] == "running"
    assert (stats["step"], stats["total_steps"]) == (LAST_STEP, TOTAL_STEPS)
    assert stats["progress"] == pytest.approx(LAST_STEP / TOTAL_STEPS)
    assert stats["loss"] == pytest.approx(demo_loss(LAST_STEP, replay=True))
    assert 0 < stats["loss_smoothed"] < 1.5
    assert stats["best_eval"]["step"] == 30 and stats["best_eval"]["metrics"] == {"accuracy": 0.75}
    assert stats["lr"] == pytest.approx(1e-4 * (1 - LAST_STEP / TOTAL_STEPS))
    assert stats["tokens_per_sec"] == 1000.0 + LAST_STEP
    assert stats["eta_seconds"] == TOTAL_STEPS - LAST_STEP
    assert stats["elapsed_seconds"] == pytest.approx(60, abs=5)
    assert stats["last_checkpoint"]["name"] == "checkpoint-40"
    assert stats["error_count"] == 0 and stats["nonfinite_steps"] == 1 and stats["resumes"] == 1
    assert stats["bad_lines"] == {runfolder.TRAINING_LOG: 1}  # the garbage line (not the half-written one)
    named = get(client, f"/api/stats?run={DEMO}")
    assert {k: named[k] for k in ("run", "step", "loss", "best_eval")} == {
        k: stats[k] for k in ("run", "step", "loss", "best_eval")
    }


def test_failed_run_reports_its_error(client):
    stats = get(client, "/api/stats?run=failed")
    assert stats["status"] == "failed" and stats["error_count"] == 1 and stats["eta_seconds"] is None
    errors = get(client, "/api/errors?run=failed")
    assert errors["count"] == 1
    assert errors["errors"][0]["type"] == "RuntimeError"
    assert "Traceback" in errors["errors"][0]["traceback"]


def write_running(root: Path, name: str, last_ts: float, interval: float = 1.0, **run_json) -> Path:
    run = root / name
    records = [train_record(s, last_ts - (10 - s) * interval, 1.0) for s in range(1, 11)]
    append(run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG, records)
    runfolder.write_json_atomic(
        run / runfolder.RUN_JSON, {"status": "running", "started_at": last_ts - 100, **run_json}
    )
    return run


def test_status_stalled_when_quiet_for_much_longer_than_a_step(tmp_path: Path):
    now = time.time()
    write_running(tmp_path, "alive", now - 5)
    write_running(tmp_path, "quiet", now - 120)
    write_running(tmp_path, "slow", now - 120, interval=20.0)  # 120 s is normal for 20 s steps
    client = create_app(tmp_path).test_client()
    assert get(client, "/api/stats?run=alive")["status"] == "running"
    quiet = get(client, "/api/stats?run=quiet")
    assert (
        quiet["status"] == "stalled"
        and quiet["status_reason"] == "no new step for 2 min (usually one every 1 s)"
    )
    assert quiet["eta_seconds"] is None
    assert get(client, "/api/stats?run=slow")["status"] == "running"
    listing = {r["name"]: r["status"] for r in get(client, "/api/runs")["runs"]}
    assert listing == {"alive": "running", "quiet": "stalled", "slow": "running"}


def test_a_killed_run_is_dead_at_once_on_its_host(tmp_path: Path):
    """SIGKILL leaves run.json saying running; its pid gone from this host makes it dead, not stalled."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_running(tmp_path, "killed", time.time() - 1, pid=victim.pid, hosts=[socket.gethostname()])
    write_running(tmp_path, "elsewhere", time.time() - 1, pid=victim.pid, hosts=["another-node"])
    client = create_app(tmp_path).test_client()
    assert get(client, "/api/stats?run=killed")["status"] == "running"
    victim.kill()  # a zombie until reaped: still counts as gone
    deadline = time.monotonic() + 5  # SIGKILL lands within milliseconds; the next poll sees it
    while (dead := get(client, "/api/stats?run=killed"))["status"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dead["status"] == "dead" and f"pid {victim.pid}" in dead["status_reason"]
    assert dead["eta_seconds"] is None
    victim.wait()
    listing = {r["name"]: r["status"] for r in get(client, "/api/runs")["runs"]}
    assert listing == {"killed": "dead", "elsewhere": "running"}  # another host's pid says nothing here
    assert 'finetune_status{run="killed",status="dead"} 1' in client.get("/metrics?all=1").get_data(
        as_text=True
    )


def test_ages_read_as_words():
    assert [age_words(s) for s in (0, 42, 60, 82, 3600, 7500, 86400, 200000)] == [
        "0 s", "42 s", "1 min", "1 min 22 s", "1 h", "2 h 5 min", "1 day", "2 days 7 h"
    ]  # fmt: skip


def test_status_from_run_end_event_and_errors(tmp_path: Path):
    now = time.time()
    ended = write_running(tmp_path, "ended", now - 5)
    append(
        ended / runfolder.LOGS_DIR / runfolder.EVENTS_LOG,
        [{"ts": now, "event": "run_end", "step": 10, "status": "interrupted"}],
    )
    crashed = write_running(tmp_path, "crashed", now - 5)
    append(
        crashed / runfolder.LOGS_DIR / runfolder.ERROR_LOG,
        [{"ts": now, "step": 10, "type": "ValueError", "message": "x", "traceback": ""}],
    )
    client = create_app(tmp_path).test_client()
    assert get(client, "/api/stats?run=ended")["status"] == "interrupted"
    assert get(client, "/api/stats?run=crashed")["status"] == "failed"


def test_metrics_series_follow_the_contract(client, log_root: Path):
    result = get(client, "/api/metrics?field=loss&max_points=0")
    points = result["series"]["loss"]["points"]
    expected = runfolder.last_per_step(
        list(runfolder.iter_records(log_root / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG))
    )
    assert [p[1] for p in points] == [r["step"] for r in expected] == list(range(1, LAST_STEP + 1))
    assert [p[2] for p in points] == [r["loss"] for r in expected]
    assert points[NAN_STEP - 1][2] is None  # NaN is null, never a bare NaN
    assert points[22][2] == pytest.approx(demo_loss(23, replay=True))  # replayed step: the last record wins
    assert points[0][0] == expected[0]["ts"]
    assert result["last_step"] == LAST_STEP and result["series"]["loss"]["dropped"] == 0


def test_metrics_downsampling_since_step_and_several_fields(client):
    result = get(client, "/api/metrics?field=loss,lr&field=grad_norm&max_points=6&since_step=5")
    for name in ("loss", "lr", "grad_norm"):
        series = result["series"][name]
        steps = [p[1] for p in series["points"]]
        assert steps[0] == 5 and steps[-1] == LAST_STEP
        assert len(steps) <= 6 and series["total"] == LAST_STEP - 4
        assert series["dropped"] == series["total"] - len(steps)


def test_metrics_csv(client):
    text = get(client, "/api/metrics?field=loss,lr&format=csv&max_points=0")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert set(rows[0]) == {"field", "wall_time", "step", "value"}
    loss = [r for r in rows if r["field"] == "loss"]
    assert len(loss) == LAST_STEP and loss[NAN_STEP - 1]["value"] == ""
    assert float(loss[0]["value"]) == pytest.approx(demo_loss(1))


def test_metrics_of_eval_log(client):
    result = get(client, "/api/metrics?log=eval&field=eval_loss,metrics.accuracy")
    assert [p[1:] for p in result["series"]["eval_loss"]["points"]] == [
        [10, 2.0],
        [20, 1.5],
        [30, 1.2],
        [40, 1.3],
    ]
    assert [p[2] for p in result["series"]["metrics.accuracy"]["points"]] == [None, None, 0.75, None]


def test_new_records_are_read_incrementally(client, log_root: Path, monkeypatch):
    get(client, "/api/stats")
    parsed = []
    import trainer.runfolder.reader as reader

    original = reader.parse_lines
    monkeypatch.setattr(reader, "parse_lines", lambda lines: parsed.append(len(lines)) or original(lines))
    log = log_root / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    # The half-written step 41 is completed, then step 42 arrives.
    with open(log, "ab") as handle:
        handle.write(b'ss": 0.5}\n')
    append(log, [train_record(42, time.time(), 0.42)])
    stats = get(client, "/api/stats")
    assert stats["step"] == 42 and stats["loss"] == 0.42
    assert sum(parsed) == 2  # only the two new lines were parsed
    assert get(client, "/api/metrics?since_step=41")["series"]["loss"]["points"][0][1:] == [41, 0.5]


def test_evals_and_checkpoints(client):
    evals = get(client, "/api/evals")
    assert evals["count"] == 4 and evals["best"]["step"] == 30
    table = get(client, "/api/checkpoints")
    rows = {r["name"]: r for r in table["checkpoints"]}
    assert list(rows) == ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40"]
    assert rows["checkpoint-10"]["pruned"] and not rows["checkpoint-10"]["on_disk"]
    assert all(
        rows[n]["on_disk"] and not rows[n]["pruned"]
        for n in ("checkpoint-20", "checkpoint-30", "checkpoint-40")
    )
    assert table["best"] == "checkpoint-30" and [r["best"] for r in rows.values()] == [
        False,
        False,
        True,
        False,
    ]
    assert rows["checkpoint-20"]["size_bytes"] == 4096 * 20 and rows["checkpoint-20"]["metric"] == "eval_loss"
    assert (table["on_disk"], table["pruned"]) == (3, 1)


def test_checkpoint_folders_without_events(tmp_path: Path):
    run = tmp_path / "run"
    append(run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG, [train_record(1, time.time(), 1.0)])
    folder = run / "checkpoint-7"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"x" * 1234)
    (folder / runfolder.TRAINER_STATE).write_text(
        json.dumps({"step": 7, "metric": "eval_loss", "metric_value": 0.5, "ts": 123.0})
    )
    (run / "final-checkpoint-9").mkdir()
    (run / ".tmp-checkpoint-11").mkdir()  # incomplete: never listed
    rows = get(create_app(tmp_path).test_client(), "/api/checkpoints")["checkpoints"]
    assert [(r["name"], r["step"], r["on_disk"]) for r in rows] == [
        ("checkpoint-7", 7, True),
        ("final-checkpoint-9", 9, True),
    ]
    assert rows[0]["size_bytes"] >= 1234 and rows[0]["metric_value"] == 0.5 and rows[0]["ts"] == 123.0
    assert rows[1]["kind"] == "final"


def test_events_filter_and_limit(client):
    everything = get(client, "/api/events")
    assert everything["total"] == 10 and everything["counts"]["checkpoint_saved"] == 4
    resumes = get(client, "/api/events?event=resume,best_updated")
    assert [e["event"] for e in resumes["events"]] == ["resume", "best_updated"]
    assert [e["event"] for e in get(client, "/api/events?limit=2")["events"]] == [
        "step_skipped",
        "checkpoint_saved",
    ]


def test_gpu_latest_and_series(client):
    result = get(client, "/api/gpu?max_points=4&field=util_pct,cpu_pct")
    devices = {d["key"]: d for d in result["devices"]}
    assert set(devices) == {"node1/cuda:0", "node1/cuda:1", "node1/cpu"}
    assert devices["node1/cuda:0"]["util_pct"] == 61 and devices["node1/cuda:1"]["mem_used_mb"] == 2110
    series = result["series"]["node1/cuda:0"]["util_pct"]
    assert series["total"] == 12 and len(series["points"]) <= 4 and series["points"][-1][1] == 61.0
    assert "cpu_pct" in result["series"]["node1/cpu"]
    assert "series" not in get(client, "/api/gpu?series=0")


def test_experts_windows(client):
    latest = get(client, "/api/experts")
    assert latest["windows"] == 1 and (latest["from_step"], latest["to_step"]) == (21, 30)
    assert latest["num_experts"] == 4 and len(latest["matrix"]) == 2
    assert latest["matrix"][0] == pytest.approx([0.125, 0.125, 0.125, 0.625])
    assert latest["layers"][0]["imbalance"] == pytest.approx(2.5)
    everything = get(client, "/api/experts?window=all")
    assert everything["windows"] == 3  # the replayed window at step 20 counts once
    assert everything["layers"][0]["counts"] == [10 + 50 + 10, 10 + 10 + 10, 10 + 10 + 10, 10 + 10 + 50]
    ranged = get(client, "/api/experts?from_step=11&to_step=20")
    assert ranged["windows"] == 1 and ranged["layers"][1]["counts"] == [100, 20, 20, 20]
    assert math.isclose(sum(ranged["matrix"][1]), 1.0)
    assert get(client, "/api/experts?run=empty")["layers"] == []


def test_prometheus_text(client):
    text = get(client, "/metrics")
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['finetune_step{run="demo"}'] == str(LAST_STEP)
    assert samples['finetune_status{run="demo",status="running"}'] == "1"
    assert samples['finetune_status{run="demo",status="stalled"}'] == "0"
    assert samples['finetune_gpu_utilization_percent{run="demo",host="node1",device="cuda:1"}'] == "51"
    assert "# TYPE finetune_loss gauge" in text
    assert not any(v in ("nan", "NaN", "None") for v in samples.values())
    everything = get(client, "/metrics?all=1")
    assert 'finetune_status{run="failed",status="failed"} 1' in everything


@pytest.mark.parametrize(
    "url",
    [
        "/api/metrics?since_step=abc",
        "/api/metrics?since_step=-1",
        "/api/metrics?max_points=1",
        "/api/metrics?max_points=lots",
        "/api/metrics?field=no_such_field",
        "/api/metrics?log=other",
        "/api/metrics?format=xml",
        "/api/metrics?log=eval&field=loss",
        "/api/events?limit=0",
        "/api/events?event=<script>",
        "/api/events?since_ts=nan",
        "/api/gpu?series=maybe",
        "/api/gpu?max_points=-5",
        "/api/experts?window=some",
        "/api/experts?from_step=20&to_step=10",
        "/api/plots/loss.png?smoothing=fancy",
        "/api/plots/loss.png?weight=1.5",
        "/api/plots/loss.png?weight=inf",
        "/api/plots/loss.png?log=perhaps",
        "/api/plots/loss.png?ma_window=0",
        "/metrics?all=sometimes",
    ],
)
def test_bad_parameters_are_400_with_a_message(client, url: str):
    body = get(client, url, 400)
    assert body["status"] == 400
    assert any(word in body["error"] for word in ("parameter", "unknown field", "must not be greater"))


@pytest.mark.parametrize("url", [*ENDPOINTS, "/api/plots/loss.png", "/"])
def test_unknown_run_is_404(client, url: str):
    response = client.get(f"{url}?run=nope", headers={"Accept": "application/json"})
    assert response.status_code == 404
    if url.startswith("/api") or url == "/metrics":
        assert response.get_json() == {"error": response.get_json()["error"], "status": 404}


def test_unknown_routes_methods_and_plots(client):
    assert get(client, "/api/nothing", 404)["status"] == 404
    assert "unknown plot" in get(client, "/api/plots/secrets.png", 404)["error"]
    for method in (client.post, client.put, client.delete):
        assert method("/api/stats").status_code == 405


def reject_constant(name: str):
    raise AssertionError(f"bare {name} in JSON output")


@pytest.mark.parametrize("run", ["junk", "empty", "bare", "sweep/lr-1e-4", "failed", DEMO])
def test_odd_runs_never_give_500(client, run: str):
    for url in ENDPOINTS:
        response = client.get(f"{url}?run={run}")
        assert response.status_code == 200, (url, run, response.get_data(as_text=True)[:300])
        if response.is_json:
            json.loads(response.get_data(as_text=True), parse_constant=reject_constant)
    assert client.get(f"/api/metrics?run={run}&log=eval").status_code == 200
    assert client.get(f"/?run={run}").status_code == 200


def test_empty_log_root(tmp_path: Path):
    client = create_app(tmp_path / "missing").test_client()
    assert get(client, "/api/runs") == {"latest": None, "runs": []}
    assert "no runs" in get(client, "/api/stats", 404)["error"]
    assert b"No runs under" in client.get("/").data
    assert get(client, "/health") == {"status": "ok"}


WEIRD = {
    runfolder.TRAINING_LOG: [
        {"step": 1, "ts": "yesterday", "loss": "low", "lr": [1], "tokens": 10**400, "total_steps": "many"},
        {"step": -5, "loss": 1.0},
        {"step": 2.0, "loss": 1.0},
        {"step": 3, "ts": None, "loss": None, "nonfinite": "loss", "epoch": True, "skipped": "yes"},
        {"step": 4, "ts": 1e308, "loss": -1e308, "total_steps": 0},
    ],
    runfolder.EVAL_LOG: [
        {"step": 1, "eval_loss": "x", "metrics": [1, 2], "task": 7, "is_best": "yes"},
        {"step": 2, "eval_loss": None, "metrics": {"acc": "high", "f1": None}},
    ],
    runfolder.EVENTS_LOG: [
        {"event": "checkpoint_saved", "step": "ten", "path": 42, "size_bytes": "big", "metric_value": "x"},
        {"event": "checkpoint_pruned", "path": None},
        {"event": "best_updated", "step": None, "path": ["a"]},
        {"event": "resume", "step": "x"},
        {"event": "run_end", "status": 3},
        {"event": 5},
    ],
    runfolder.ERROR_LOG: [{"type": "E", "step": "s", "ts": "t", "message": None, "traceback": 5}],
    runfolder.GPU_LOG: [
        {"device": 0, "host": "h"},
        {"device": "cuda:0", "host": None, "util_pct": "busy", "ts": "now"},
    ],
    runfolder.EXPERT_LOG: [
        {"step": 1, "layers": [1, 2]},
        {"step": 2, "layers": [{"counts": ["a", -3, None, 1e400, 5]}], "num_experts": "many"},
        {"step": 3, "start_step": "x", "layers": [{"layer": "first", "counts": []}, {"counts": [1, 2]}]},
    ],
}


def test_weird_but_valid_records_never_500(tmp_path: Path):
    run = tmp_path / "weird"
    for name, records in WEIRD.items():
        log = run / runfolder.LOGS_DIR / name
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(json.dumps(r) + "\n" for r in records) + "NaN\n[]\n")
    (run / runfolder.RUN_JSON).write_text('["not", "an", "object"]')
    (run / "checkpoint-3").mkdir()
    (run / "checkpoint-3" / runfolder.TRAINER_STATE).write_text('{"ts": "soon", "metric_value": "x"}')
    client = create_app(tmp_path).test_client()
    urls = [*ENDPOINTS, "/api/runs", "/", "/api/experts?window=all", "/api/metrics?log=eval&field=metrics.f1"]
    urls += [f"/api/plots/{name}.png?log=1" for name in ("loss", "lr", "gpu_util", "experts")]
    urls += ["/api/plots/loss.png?smoothing=ma", "/api/plots/experts.png?window=all"]
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, (url, response.get_data(as_text=True)[:300])
    stats = client.get("/api/stats").get_json()
    assert stats["step"] == 4 and stats["bad_lines"][runfolder.TRAINING_LOG] == 4  # two bad steps, NaN, []


def test_stats_say_which_kernels_trained_and_how_their_self_check_went(client, log_root):
    """The run header's kernel line: from the model_report and kernel_check events the trainer writes."""
    events = log_root / DEMO / runfolder.LOGS_DIR / runfolder.EVENTS_LOG
    assert get(client, "/api/stats")["kernels"] is None  # older runs logged neither
    checks = [
        {"kernel": "lora_linear", "error": 0.004, "tolerance": 0.03, "passed": True},
        {"kernel": "fused_cross_entropy", "error": 0.0021, "tolerance": 0.03, "passed": True},
    ]
    report = {"ts": time.time(), "event": "model_report", "step": 0, "kernel_path": "transformers"}
    fast = {"enabled": True, "reason": "", "self_check": checks}
    append(events, [{**report, "fast_path": fast}, {"ts": time.time(), "event": "kernel_check", "step": 0,
                                                  "passed": True, "results": checks}])  # fmt: skip
    kernels = get(client, "/api/stats")["kernels"]
    assert kernels["fast_path"] is True and kernels["self_check_passed"] is True
    assert kernels["self_check_max_error"] == pytest.approx(0.004)
    assert kernels["summary"] == "fast path, kernels checked (max error 4.0e-03)"
    assert "fast path, kernels checked" in client.get(f"/?run={DEMO}").get_data(as_text=True)
    assert kernels["cuda_graphs"] is None
    graphs = {"ts": time.time(), "event": "cuda_graphs", "step": None, "state": "replaying"}
    append(events, [{**graphs, "detail": "hidden states 4x2048x2048"}])
    kernels = get(client, "/api/stats")["kernels"]
    assert kernels["summary"] == "fast path + CUDA graphs, kernels checked (max error 4.0e-03)"
    assert kernels["cuda_graphs"] == {"state": "replaying", "detail": "hidden states 4x2048x2048"}
    append(events, [{**graphs, "state": "off", "detail": "capturing layer LlamaDecoderLayer failed: ..."}])
    assert get(client, "/api/stats")["kernels"]["summary"].startswith("fast path (CUDA graphs off), kernels")
    failed = [{**checks[0], "error": 0.4, "passed": False}]
    append(
        events, [{"ts": time.time(), "event": "kernel_check", "step": 0, "passed": False, "results": failed}]
    )
    kernels = get(client, "/api/stats")["kernels"]
    assert kernels["self_check_passed"] is False and kernels["self_check_failed"] == ["lora_linear"]
    assert kernels["summary"] == "reference path: kernel self-check FAILED (lora_linear)"


def test_stats_name_a_family_kernel_path_and_its_self_check(client, log_root):
    """GLA and Mamba runs: the header names the path that trained, checked or moved there by a failed check."""
    events = log_root / DEMO / runfolder.LOGS_DIR / runfolder.EVENTS_LOG
    checks = [
        {"kernel": "chunk_gla", "error": 0.0012, "tolerance": 0.01, "passed": True},
        {"kernel": "rms_norm", "error": 0.0004, "tolerance": 0.01, "passed": True},
    ]
    fast = {
        "enabled": False,
        "reason": "the gla family runs its own kernels (fla-triton)",
        "self_check": checks,
    }
    report = {
        "ts": time.time(),
        "event": "model_report",
        "step": 0,
        "kernel_path": "fla-triton",
        "fast_path": fast,
    }
    append(
        events,
        [report, {"ts": time.time(), "event": "kernel_check", "step": 0, "passed": True, "results": checks}],
    )
    kernels = get(client, "/api/stats")["kernels"]
    assert kernels["summary"] == "kernels: fla-triton, checked (max error 1.2e-03)"
    assert kernels["kernel_path"] == "fla-triton" and kernels["self_check_passed"] is True
    failed = [{**checks[0], "error": 0.25, "passed": False}, checks[1]]
    moved = {**report, "kernel_path": "fla-naive-torch", "fast_path": {**fast, "self_check": failed}}
    append(
        events,
        [moved, {"ts": time.time(), "event": "kernel_check", "step": 0, "passed": False, "results": failed}],
    )
    kernels = get(client, "/api/stats")["kernels"]
    assert kernels["summary"] == "kernels: fla-naive-torch, after a failed kernel self-check (chunk_gla)"
    assert kernels["self_check_failed"] == ["chunk_gla"]
    assert "after a failed kernel self-check (chunk_gla)" in client.get(f"/?run={DEMO}").get_data(
        as_text=True
    )
