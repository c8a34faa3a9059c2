"""The runs overview page and API: every run with status, progress, best metric and sweep, sortable."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from dashboard import create_app
from trainer import runfolder


def write_run(folder: Path, status: str, steps: tuple[int, int], evals: list[dict], task: str | None = None):
    now = time.time()
    runfolder.write_json_atomic(
        (folder.mkdir(parents=True) or folder) / runfolder.RUN_JSON,
        {
            "run_id": folder.name,
            "status": status,
            "started_at": now - 100 + len(folder.name),
            "total_steps": steps[1],
        },
    )
    logs = folder / runfolder.LOGS_DIR
    logs.mkdir()
    step, total = steps
    train = [
        {"ts": now - (step - s), "step": s, "total_steps": total, "loss": 2.0} for s in range(1, step + 1)
    ]
    (logs / runfolder.TRAINING_LOG).write_text("".join(runfolder.encode_record(r) for r in train))
    records = []
    for e in evals:
        record = {"ts": now, "step": e["step"], "eval_loss": e.get("eval_loss", 1.0)}
        if "accuracy" in e:
            record.update(metrics={"accuracy": e["accuracy"]}, task=task)
        records.append(runfolder.encode_record(record))
    (logs / runfolder.EVAL_LOG).write_text("".join(records))


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "runs"
    write_run(
        root / "solo", "finished", (10, 10), [{"step": 5, "eval_loss": 1.7}, {"step": 10, "eval_loss": 1.5}]
    )
    sweep = root / "grid"
    write_run(
        sweep / "tiny_sst2_seed1",
        "running",
        (5, 20),
        [{"step": 4, "accuracy": 0.8}, {"step": 5, "accuracy": 0.85}],
        "sst2",
    )
    write_run(sweep / "tiny_sst2_seed2", "failed", (3, 20), [{"step": 2, "accuracy": 0.6}], "sst2")
    jobs = [
        {"name": n, "state": s, "output_dir": str(sweep / n)}
        for n, s in (
            ("tiny_sst2_seed1", "running"),
            ("tiny_sst2_seed2", "failed"),
            ("tiny_sst2_seed3", "queued"),
        )
    ]
    summary = {"sweep": "grid-a", "status": "running", "updated_at": time.time(), "jobs": jobs,
               "counts": {"queued": 1, "running": 1, "done": 0, "failed": 1}}  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps(summary))
    return root


@pytest.fixture
def client(root):
    return create_app(root, {"TESTING": True}).test_client()


def test_api_lists_every_run_with_status_progress_best_and_sweep(client):
    data = client.get("/api/overview").get_json()
    assert data["count"] == 3
    rows = {r["name"]: r for r in data["runs"]}
    assert set(rows) == {"solo", "grid/tiny_sst2_seed1", "grid/tiny_sst2_seed2"}
    solo, running, failed = rows["solo"], rows["grid/tiny_sst2_seed1"], rows["grid/tiny_sst2_seed2"]
    assert (solo["status"], solo["progress"], solo["sweep"]) == ("finished", 1.0, None)
    assert solo["best"] == {
        "metric": "eval_loss",
        "value": 1.5,
        "step": 10,
        "task": None,
        "greater_is_better": False,
    }
    assert (running["status"], running["step"], running["total_steps"]) == ("running", 5, 20)
    assert running["progress"] == pytest.approx(0.25) and running["sweep"] == "grid-a"
    assert (
        running["best"]["metric"] == "accuracy"
        and running["best"]["value"] == 0.85
        and running["best"]["step"] == 5
    )
    assert failed["status"] == "failed" and failed["best"]["value"] == 0.6
    assert data["sweeps"] == [
        {"sweep": "grid-a", "folder": "grid", "status": "running", "jobs": 3,
         "counts": {"queued": 1, "running": 1, "done": 0, "failed": 1}, "updated_at": pytest.approx(time.time(), abs=60)}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("query", "order"),
    [
        ("sort=name&order=asc", ["grid/tiny_sst2_seed1", "grid/tiny_sst2_seed2", "solo"]),
        ("sort=best&order=desc", ["solo", "grid/tiny_sst2_seed1", "grid/tiny_sst2_seed2"]),
        ("sort=progress&order=asc", ["grid/tiny_sst2_seed2", "grid/tiny_sst2_seed1", "solo"]),
        ("sort=sweep&order=asc", ["grid/tiny_sst2_seed1", "grid/tiny_sst2_seed2", "solo"]),  # no sweep: last
        (
            "sort=status",
            ["grid/tiny_sst2_seed2", "solo", "grid/tiny_sst2_seed1"],
        ),  # text: ascending by default
    ],
)
def test_sorting_is_the_same_for_page_and_api(client, query, order):
    assert [r["name"] for r in client.get(f"/api/overview?{query}").get_json()["runs"]] == order
    page = client.get(f"/runs?{query}").get_data(as_text=True)
    assert re.findall(r'<tr data-run="([^"]+)"', page) == order


def test_page_rows_link_to_runs_and_headers_sort(client):
    response = client.get("/runs?sort=best&order=desc")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert '<a href="/?run=grid/tiny_sst2_seed1">grid/tiny_sst2_seed1</a>' in page
    assert '<th data-key="best" data-type="num" aria-sort="descending">' in page
    assert 'href="/runs?sort=best&amp;order=asc"' in page  # clicking the sorted column flips it
    assert 'href="/runs?sort=name&amp;order=asc"' in page and 'href="/runs?sort=step&amp;order=desc"' in page
    assert "accuracy 0.85" in page and "eval_loss 1.5" in page
    assert '<progress max="1" value="0.25"></progress> 25%' in page
    assert '<tr data-sweep="grid-a">' in page
    assert (
        '<script src="/static/overview.js"></script>' in page and "<script>" not in page
    )  # CSP: no inline code
    script = client.get("/static/overview.js")
    assert script.status_code == 200 and b"aria-sort" in script.data
    linked = client.get("/?run=grid/tiny_sst2_seed1")
    assert linked.status_code == 200 and b'data-run="grid/tiny_sst2_seed1"' in linked.data
    assert b'<a id="all-runs" href="/runs">all runs</a>' in linked.data  # and back to the overview


def test_bad_sort_is_400_and_the_token_is_required_and_carried(root):
    client = create_app(root, {"TESTING": True, "DASHBOARD_TOKEN": "s3cret"}).test_client()
    assert client.get("/runs").status_code == 401
    assert client.get("/api/overview").status_code == 401
    bad = client.get("/api/overview?sort=size&token=s3cret")
    assert bad.status_code == 400 and "parameter 'sort' must be one of name, sweep" in bad.get_json()["error"]
    page = client.get("/runs?token=s3cret").get_data(as_text=True)
    assert '<a href="/?run=solo&amp;token=s3cret">solo</a>' in page
    assert "/static/overview.js?token=s3cret" in page
    assert b'href="/runs?token=s3cret">all runs</a>' in client.get("/?token=s3cret").data


def test_empty_root_and_a_broken_sweep_file(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "sweep.json").write_text("{broken")
    client = create_app(tmp_path, {"TESTING": True}).test_client()
    assert client.get("/api/overview").get_json() | {"root": None} == {
        "root": None, "count": 0, "sort": "started_at", "order": "desc", "runs": [], "sweeps": []
    }  # fmt: skip
    assert "No runs under" in client.get("/runs").get_data(as_text=True)
