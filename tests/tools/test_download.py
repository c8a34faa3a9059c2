"""``download``: against a local HTTP server that answers like the Hub (tests/hub_server.py, through
HF_ENDPOINT), and against a folder laid out as the Hub cache (HF_HOME, offline).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, trainer_env
from tests.tools.hub_server import COMMIT, REPO_ID, FakeHub, tiny_repo


def hub_env(tmp_path: Path, endpoint: str | None = None, **extra: str) -> dict:
    env = trainer_env()
    for key in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT"):
        env.pop(key, None)
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        **extra,
    )
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def download(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "download", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_download_from_hub_endpoint_into_folder_verifies_every_file(tmp_path):
    files = tiny_repo()
    target = tmp_path / "model"
    with FakeHub(files, token="hf_secret_test_token") as hub:
        result = download(
            hub_env(tmp_path, hub.url, HF_TOKEN="hf_secret_test_token"), REPO_ID, "--to", str(target)
        )
    assert result.returncode == 0, result.stderr
    for name, data in files.items():
        assert (target / name).read_bytes() == data
    # The token came from HF_TOKEN, and every file came through the resolve endpoint at the sized commit.
    assert all(h.get("authorization") == "Bearer hf_secret_test_token" for _, _, h in hub.requests)
    assert sorted(p.rsplit("/", 1)[-1] for p in hub.paths_requested("GET") if "/resolve/" in p) == sorted(
        files
    )
    assert all(f"/resolve/{COMMIT}/" in p for p in hub.paths_requested("GET") if "/resolve/" in p)
    assert "verified: config.json" in result.stdout
    assert "2 weight shard(s) from model.safetensors.index.json" in result.stdout
    assert "tokenizer (tokenizer.json)" in result.stdout
    assert "disk: " in result.stdout and "free left" in result.stdout
    assert "6 files" in result.stderr and "to fetch" in result.stderr
    assert "hf_secret_test_token" not in result.stdout + result.stderr

    # huggingface_hub trusts a file it placed before, whatever its size: verification finds it short
    # against the Hub's listing, and the command fetches it again.
    shard = target / "model-00001-of-00002.safetensors"
    shard.write_bytes(files["model-00001-of-00002.safetensors"][:-10])
    (target / "tokenizer_config.json").write_bytes(files["tokenizer_config.json"][:-3])
    with FakeHub(files) as hub:
        again = download(hub_env(tmp_path, hub.url), REPO_ID, "--to", str(target))
    assert again.returncode == 0, again.stderr
    assert (
        "re-fetching damaged file(s): model-00001-of-00002.safetensors, tokenizer_config.json" in again.stderr
    )
    assert shard.read_bytes() == files["model-00001-of-00002.safetensors"]
    fetched = sorted(p.rsplit("/", 1)[-1] for p in hub.paths_requested("GET") if "/resolve/" in p)
    assert fetched == ["model-00001-of-00002.safetensors", "tokenizer_config.json"]


def test_download_into_cache_resumes_a_dropped_file_and_keeps_finished_ones(tmp_path):
    # Over huggingface_hub's 10 MiB write chunk, so the bytes before the break reach the disk.
    files = tiny_repo(rows=96 * 1024)
    shard = "model-00002-of-00002.safetensors"
    with FakeHub(files, drop_once={shard}) as hub:
        env = hub_env(tmp_path, hub.url)
        first = download(env, REPO_ID)
        # The connection broke near the end of the shard: the rest came with a Range request.
        ranges = [h.get("range") for m, p, h in hub.requests if m == "GET" and p.endswith(shard)]
        snapshot = tmp_path / "hf-home" / "hub" / "models--tiny-org--tiny-model" / "snapshots" / COMMIT
        (snapshot / shard).resolve().unlink()  # as if the next run had been killed before the last file
        (snapshot / shard).unlink()
        hub.requests.clear()
        second = download(env, REPO_ID)
    assert first.returncode == 0, first.stderr
    assert ranges == [None, f"bytes={10 * 1024 * 1024}-"], ranges
    assert second.returncode == 0, second.stderr
    assert str(snapshot) in second.stdout
    assert (snapshot / shard).read_bytes() == files[shard]
    fetched = [p.rsplit("/", 1)[-1] for p in hub.paths_requested("GET") if "/resolve/" in p]
    assert fetched == [shard], "files already in the cache are not fetched again"
    assert f"{len(files[shard]) / 1e6:.1f} MB to fetch" in second.stderr


def test_download_refuses_when_the_repository_does_not_fit(tmp_path):
    files = tiny_repo()
    with FakeHub(files) as hub:
        result = download(
            hub_env(tmp_path, hub.url), REPO_ID, "--to", str(tmp_path / "m"), "--keep-free", "1000TB"
        )
    assert result.returncode == 2
    assert "not enough disk space" in result.stderr and REPO_ID in result.stderr
    assert not any("/resolve/" in p for p in hub.paths_requested("GET")), "refused before downloading"


def test_download_free_space_check_compares_repo_size_with_free_bytes(tmp_path, monkeypatch):
    from trainer.tools import hub

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 500, 500))
    plan = hub.Plan(REPO_ID, COMMIT, {"model.safetensors": 501}, 501, tmp_path)
    with pytest.raises(hub.HubError, match=r"needs 501 B, but .* has 500 B free"):
        hub.check_space(plan)
    assert hub.check_space(hub.Plan(REPO_ID, COMMIT, {"a": 500}, 500, tmp_path)) == 500


def test_download_names_unknown_repository_and_revision(tmp_path):
    with FakeHub(tiny_repo()) as hub:
        env = hub_env(tmp_path, hub.url)
        missing = download(env, "tiny-org/no-such-model")
        bad_revision = download(env, REPO_ID, "--revision", "v9")
    assert missing.returncode == 2 and "repository not found" in missing.stderr
    assert "tiny-org/no-such-model" in missing.stderr
    assert (
        bad_revision.returncode == 2 and "revision not found: tiny-org/tiny-model@v9" in bad_revision.stderr
    )


def make_hub_cache(home: Path, files: dict[str, bytes]) -> Path:
    """The Hub cache layout: blobs named by ETag, refs/main, snapshots/<commit>/ of relative symlinks."""
    storage = home / "hub" / "models--tiny-org--tiny-model"
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot


def test_download_offline_from_hub_cache_names_missing_and_truncated_shards(tmp_path):
    files = tiny_repo()
    snapshot = make_hub_cache(tmp_path / "hf-home", files)
    env = hub_env(tmp_path, HF_HUB_OFFLINE="1")

    ok = download(env, REPO_ID)
    assert ok.returncode == 0, ok.stderr
    assert str(snapshot) in ok.stdout and "2 weight shard(s)" in ok.stdout
    footprint = sum(len(d) for d in files.values())
    assert f"disk: {footprint / 1000:.1f} KB on disk" in ok.stdout

    shard = snapshot / "model-00002-of-00002.safetensors"
    blob = shard.resolve()
    blob.write_bytes(files["model-00002-of-00002.safetensors"][:-100])
    truncated = download(env, REPO_ID)
    assert truncated.returncode == 1
    assert "truncated: model-00002-of-00002.safetensors" in truncated.stderr

    blob.unlink()
    shard.unlink()
    (snapshot / "tokenizer.json").unlink()
    missing = download(env, REPO_ID)
    assert missing.returncode == 1
    assert (
        "weight shard missing: model-00002-of-00002.safetensors (named in model.safetensors.index.json)"
        in (missing.stderr)
    )
    assert "no tokenizer" in missing.stderr


def test_download_offline_without_cache_is_one_line(tmp_path):
    result = download(hub_env(tmp_path, HF_HUB_OFFLINE="1"), REPO_ID)
    assert result.returncode == 2
    assert "not in the local cache" in result.stderr
    assert "Traceback" not in result.stderr


def test_download_falls_back_to_the_cache_when_the_endpoint_is_unreachable(tmp_path):
    import socket

    snapshot = make_hub_cache(tmp_path / "hf-home", tiny_repo())
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    result = download(hub_env(tmp_path, f"http://127.0.0.1:{port}"), REPO_ID)
    assert result.returncode == 0, result.stderr
    assert f"cannot reach http://127.0.0.1:{port} (ConnectError); trying the local cache" in result.stderr
    assert str(snapshot) in result.stdout and "verified: config.json" in result.stdout


def test_download_bad_arguments_are_one_line(tmp_path, capsys):
    from trainer.cli import main as cli

    assert cli(["download", "./models/local-folder"]) == 2
    assert "MODEL_ID: expected a repository id such as org/name" in capsys.readouterr().err
    assert cli(["download", REPO_ID, "--keep-free", "lots"]) == 2
    assert "--keep-free: expected a size such as 500MB or 2GB" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli(["download", REPO_ID, "--to", str(tmp_path / "file")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
