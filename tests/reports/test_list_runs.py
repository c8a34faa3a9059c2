"""``list``: run folders written through trainer.runfolder, listed as a table and as JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.helpers import REPO, trainer_env
from trainer import runfolder
from trainer.cli import main as cli


def make_run(root: Path, name: str, age: float, evals=(), metric=None, **run_fields) -> Path:
    run_dir = root / name
    log = runfolder.RunLog(run_dir)
    if metric:
        (run_dir / runfolder.CONFIG_YAML).write_text(yaml.safe_dump({"eval": metric}))
    for record in evals:
        log.write(runfolder.EVAL_LOG, record)
    fields = {
        "run_id": f"{name}-1",
        "model": "configs/tiny-moe",
        "family": "causal",
        "method": "lora",
        "hosts": [socket.gethostname()],
        "pid": 1,
        "total_steps": 100,
        **run_fields,
    }
    log.update_run(**fields)
    info = runfolder.read_run_json(run_dir)
    info["updated_at"] = time.time() - age
    runfolder.write_json_atomic(run_dir / runfolder.RUN_JSON, info)
    log.close()
    return run_dir


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def build_root(root: Path) -> None:
    finished = make_run(
        root,
        "finished",
        age=7200,
        status="finished",
        step=100,
        evals=[
            {"step": 50, "eval_loss": 2.5, "perplexity": 12.2, "eval_tokens": 1},
            {"step": 100, "eval_loss": 2.1, "perplexity": 8.2, "eval_tokens": 1},
            {"step": 50, "eval_loss": 1.9, "perplexity": 6.7, "eval_tokens": 1},  # replayed after a resume
        ],
    )
    (finished / "checkpoint-100").mkdir()
    (finished / "checkpoint-100" / "adapter_model.safetensors").write_bytes(b"\0" * 50_000)
    with open(finished / runfolder.LOGS_DIR / runfolder.EVAL_LOG, "a") as handle:
        handle.write("garbage line\n{half a record")
    make_run(
        root,
        "sweep/lr-1e-4",
        age=60,
        status="running",
        step=40,
        pid=__import__("os").getpid(),
        metric={"metric_for_best": "accuracy", "greater_is_better": True},
        evals=[
            {"step": 20, "eval_loss": 3.0, "metrics": {"accuracy": 0.55}},
            {"step": 40, "eval_loss": 3.2, "metrics": {"accuracy": 0.71}},
        ],
    )
    glue = make_run(
        root,
        "glue-auto",
        age=600,
        status="finished",
        step=20,
        metric={
            "metric_for_best": "auto",
            "greater_is_better": None,
        },  # the task's metric, as the trainer chose
        evals=[
            {"step": 10, "eval_loss": 0.9, "metrics": {"matthews_correlation": 0.30}},
            {"step": 20, "eval_loss": 1.1, "metrics": {"matthews_correlation": 0.42}},
        ],
    )
    log = runfolder.RunLog(glue)
    log.event("best_updated", step=20, metric="matthews_correlation", metric_value=0.42, path="x")
    log.close()
    make_run(root, "crashed", age=30, status="running", step=7, pid=dead_pid())
    make_run(
        root,
        "failed",
        age=3 * 86400,
        status="failed",
        step=3,
        model="meta-llama/Llama-3.1-8B",
        method="qlora",
    )
    (root / "not-a-run").mkdir()


def test_list_json_has_status_best_metric_size_and_age(tmp_path, capsys):
    build_root(tmp_path)
    assert cli(["list", "--root", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in rows]
    assert names == ["crashed", "sweep/lr-1e-4", "glue-auto", "finished", "failed"]  # most recent first
    by_name = {r["name"]: r for r in rows}
    assert by_name["finished"]["status"] == "finished"
    assert by_name["finished"]["best"] == {"name": "eval_loss", "value": 1.9, "step": 50}
    assert by_name["finished"]["step"] == 100 and by_name["finished"]["total_steps"] == 100
    assert by_name["finished"]["size_bytes"] > 50_000
    assert 7190 < by_name["finished"]["age_seconds"] < 7300
    assert by_name["sweep/lr-1e-4"]["status"] == "running"  # its process (this one) is alive
    assert by_name["sweep/lr-1e-4"]["best"] == {"name": "accuracy", "value": 0.71, "step": 40}
    assert by_name["glue-auto"]["best"] == {"name": "matthews_correlation", "value": 0.42, "step": 20}
    assert by_name["crashed"]["status"] == "dead"  # run.json says running, but its process is gone
    assert by_name["failed"]["status"] == "failed" and by_name["failed"]["method"] == "qlora"
    assert by_name["failed"]["best"] is None


def test_list_table_and_limit(tmp_path, capsys):
    build_root(tmp_path)
    assert cli(["list", "--root", str(tmp_path), "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "MODEL", "METHOD", "STEPS", "BEST", "SIZE", "UPDATED"]
    assert len(lines) == 4 and not any(line.startswith("finished") for line in lines)
    assert cli(["list", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    finished = next(line for line in lines if line.startswith("finished"))
    assert "100/100" in finished and "eval_loss 1.9 @50" in finished and "2h ago" in finished
    assert "KB" in finished
    assert "accuracy 0.71 @40" in next(line for line in lines if line.startswith("sweep/lr-1e-4"))


def test_list_bad_root_and_empty_root(tmp_path, capsys):
    assert cli(["list", "--root", str(tmp_path / "missing")]) == 2
    assert "--root: folder not found" in capsys.readouterr().err
    assert cli(["list", "--root", str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().out


def test_list_runs_from_the_command_line_without_torch(tmp_path):
    build_root(tmp_path)
    code = (
        "import sys; from trainer.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'list imported torch'; raise SystemExit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "list", "--root", str(tmp_path), "--json"],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 5


def test_list_into_a_closed_pipe_ends_quietly(tmp_path):
    """`python -m trainer list --json | head`: the reader is gone; no BrokenPipeError traceback."""
    build_root(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `head` after its lines: every write now fails with EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "trainer", "list", "--json", "--root", str(tmp_path)],
            cwd=REPO,
            env=trainer_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, as `cat` reports it
