"""The chart data behind the page: /api/series (row-aligned columns, since_step, downsampling that keeps
each field's spikes, tokens seen), /api/config (one run's settings, or only what differs between runs),
the overview's hyperparameter columns, and telemetry as CSV."""

from __future__ import annotations

import json
import math
import re
import subprocess
from array import array
from pathlib import Path

import pytest

from dashboard import create_app
from tests.dashboard.fixtures import DEMO, LAST_STEP, append, demo_loss, train_record
from trainer import runfolder
from trainer.runfolder.runconfig import differing, flatten


def get(client, url: str, status: int = 200) -> dict:
    response = client.get(url)
    assert response.status_code == status, response.get_data(as_text=True)[:300]
    return response.get_json()


def test_series_are_row_aligned_columns_with_tokens_seen(client):
    data = get(client, "/api/series?field=loss,lr")
    steps = data["step"]
    assert steps == list(range(1, LAST_STEP + 1)) and data["dropped"] == 0 and data["last_step"] == LAST_STEP
    assert len(data["wall"]) == len(data["series"]["loss"]) == len(data["series"]["lr"]) == len(steps)
    replayed = [demo_loss(s, replay=s > 20) for s in steps]  # the last record for a step wins
    assert data["series"]["loss"] == [None if math.isnan(v) else pytest.approx(v) for v in replayed]
    assert data["tokens_seen"] == [512.0 * s for s in steps]  # cumulative tokens, the "tokens" x axis
    assert data["started_at"] is not None


def test_series_since_step_returns_only_new_rows(client, log_root: Path):
    first = get(client, "/api/series?field=loss")
    log = log_root / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    with open(log, "ab") as handle:
        handle.write(b"\n")  # ends the fixture's half-written line
    append(log, [train_record(LAST_STEP + 1, 1e9, 0.5), train_record(LAST_STEP + 2, 1e9 + 1, 0.4)])
    more = get(client, f"/api/series?field=loss&since_step={first['last_step'] + 1}")
    assert more["step"] == [LAST_STEP + 1, LAST_STEP + 2] and more["series"]["loss"] == [0.5, 0.4]
    assert more["tokens_seen"] == [512.0 * (LAST_STEP + 1), 512.0 * (LAST_STEP + 2)]  # counted from step 1
    assert get(client, f"/api/series?field=loss&since_step={LAST_STEP + 3}")["step"] == []


def test_series_poll_extends_the_kept_tokens_total_without_rereading_earlier_rows(
    app, client, log_root: Path
):
    first = get(client, "/api/series?field=loss")
    table = app.extensions["dashboard"].registry.get(DEMO).train.table
    # The spy: rows already summed are zeroed in memory; a poll that re-summed them would count 0 for them.
    table.columns["tokens"][:] = array("d", [0.0]) * table.rows
    log = log_root / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    with open(log, "ab") as handle:
        handle.write(b"\n")
    append(log, [train_record(LAST_STEP + 1, 1e9, 0.5), train_record(LAST_STEP + 2, 1e9 + 1, 0.4)])
    more = get(client, f"/api/series?field=loss&since_step={first['last_step'] + 1}")
    full = get(create_app(log_root).test_client(), "/api/series?field=loss")  # a fresh server reads it all
    assert (
        more["tokens_seen"] == full["tokens_seen"][-2:] == [512.0 * (LAST_STEP + 1), 512.0 * (LAST_STEP + 2)]
    )


def test_tokens_total_follows_a_replayed_step(tmp_path: Path):
    log = tmp_path / "replay" / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    append(log, [train_record(s, 1000.0 + s, 1.0) for s in range(1, 6)])
    client = create_app(tmp_path).test_client()
    assert get(client, "/api/series?field=loss")["tokens_seen"] == [512.0 * s for s in range(1, 6)]
    append(log, [{**train_record(3, 2000.0, 0.9), "tokens": 100}])  # a resume replays step 3
    assert get(client, "/api/series?field=loss&since_step=4")["tokens_seen"] == [
        512.0 * 3 + 100,
        512.0 * 4 + 100,
    ]


def test_series_downsampling_keeps_every_fields_spike(tmp_path: Path):
    records = [train_record(s, 1000.0 + s, 1.0) for s in range(1, 20001)]
    records[7000]["loss"] = 50.0
    records[13000]["grad_norm"] = 99.0
    append(tmp_path / "big" / runfolder.LOGS_DIR / runfolder.TRAINING_LOG, records)
    data = get(create_app(tmp_path).test_client(), "/api/series?field=loss,grad_norm&max_points=400")
    assert len(data["step"]) <= 420 and data["dropped"] == 20000 - len(data["step"])
    assert data["step"][0] == 1 and data["step"][-1] == 20000
    assert 50.0 in data["series"]["loss"] and 99.0 in data["series"]["grad_norm"]
    assert data["step"] == sorted(data["step"])


def test_eval_series_and_bad_fields(client):
    data = get(client, "/api/series?log=eval&field=eval_loss,metrics.accuracy")
    assert data["step"] == [10, 20, 30, 40] and data["series"]["metrics.accuracy"] == [None, None, 0.75, None]
    assert "metrics.accuracy" in data["fields"] and data["tokens_seen"] is None
    assert "unknown field(s) nope" in get(client, "/api/series?field=nope", 400)["error"]
    assert get(client, "/api/series?max_points=1", 400)["status"] == 400
    assert get(client, "/api/series?run=nope", 404)["status"] == 404


def test_config_of_one_run_and_the_diff_of_several(client):
    one = get(client, f"/api/config?run={DEMO}")
    assert one["runs"] == [DEMO] and one["values"]["lora.r"] == [16] and one["values"]["lora.alpha"] == [32]
    assert len(one["keys"]) == one["total_keys"] == 8
    diff = get(client, f"/api/config?run={DEMO},failed,sweep/lr-1e-4")
    assert diff["keys"] == ["lora.r", "optimization.learning_rate"]
    assert diff["values"]["optimization.learning_rate"] == [0.003, 0.0001, 0.0001]
    assert len(get(client, f"/api/config?run={DEMO}&run=failed&all=1")["keys"]) == 8
    missing = get(client, f"/api/config?run={DEMO},bare")
    assert missing["found"] == [True, False] and len(missing["keys"]) == 8  # absent differs from present
    assert get(client, "/api/config?run=../secret", 404)["status"] == 404


def test_flatten_and_differing():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    assert differing([{"x": 1, "y": 2}, {"x": 1, "y": 3}, {"x": 1}]) == ["y"]


def test_overview_has_hyperparameter_columns_sortable(client):
    rows = {r["name"]: r for r in get(client, "/api/overview")["runs"]}
    demo = rows[DEMO]
    assert (demo["method"], demo["lora_r"], demo["learning_rate"], demo["effective_batch"]) == (
        "lora",
        16,
        0.003,
        16,
    )
    assert demo["tokens_per_sec"] == 1000.0 + LAST_STEP and demo["model"] == "tiny-moe"
    ordered = [r["name"] for r in get(client, "/api/overview?sort=learning_rate&order=asc")["runs"]]
    assert ordered[:3] == ["failed", "sweep/lr-1e-4", DEMO]  # runs without a config last
    html = client.get("/runs").get_data(as_text=True)
    assert 'id="run-filter"' in html and 'class="pick"' in html and ">LoRA r<" in html


def test_gpu_series_as_csv(client):
    text = client.get("/api/gpu?field=util_pct&max_points=0&format=csv").get_data(as_text=True)
    lines = text.splitlines()
    assert lines[0] == "device,field,wall_time,value" and len(lines) == 1 + 2 * 12  # two GPUs, 12 samples
    assert lines[1].startswith("node1/cuda:0,util_pct,") and lines[1].endswith(",50.0")


CHARTS_JS = Path(__file__).resolve().parents[2] / "static" / "charts.js"
NODE_BUILD_DEVICES = """
globalThis.window = globalThis;
globalThis.uPlot = { join: (tables) => [tables[0][0], ...tables.map((t) => t[1])] };
require(process.argv[1]);
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const built = window.Charts.buildDevices(input.gpu, input.fields, null, window.Charts.PALETTE, false, input.labels);
console.log(JSON.stringify({ labels: built.series.map((s) => s.label), data: built.data }));
"""


def test_cpu_memory_chart_plots_the_training_process_rss_beside_the_machine_ram(tmp_path: Path):
    samples = [
        {"ts": 100.0 + i, "host": "h", "device": "cpu", "cpu_pct": 50.0, "ram_used_mb": 30000.0 + i}
        | {"ram_total_mb": 64000.0, "proc_rss_mb": 900.0 + 10 * i, "children_rss_mb": 0.0}
        for i in range(3)
    ]
    append(tmp_path / "cpu-run" / runfolder.LOGS_DIR / runfolder.GPU_LOG, samples)
    app_js = (CHARTS_JS.parent / "app.js").read_text()
    spec = re.search(
        r'gpu_memory: \{ name: "gpu_memory", devices: (\[.*?\]).*?labels: (\{.*?\}) \}', app_js, re.S
    )
    fields, labels = json.loads(spec[1]), json.loads(re.sub(r"(\w+):", r'"\1":', spec[2]))
    gpu = get(create_app(tmp_path).test_client(), f"/api/gpu?field={','.join(fields)}&max_points=1000")
    node = subprocess.run(
        ["node", "-e", NODE_BUILD_DEVICES, str(CHARTS_JS)],
        input=json.dumps({"gpu": gpu, "fields": fields, "labels": labels}),
        capture_output=True,
        text=True,
        check=True,
    )
    built = json.loads(node.stdout)
    assert built["labels"] == ["h/cpu training process RSS", "h/cpu machine RAM in use (all processes)"]
    assert built["data"][1] == [900.0, 910.0, 920.0] and built["data"][2] == [30000.0, 30001.0, 30002.0]
