"""``download``: against a local HTTP server that answers like the Hub (HF_ENDPOINT), and against a
folder laid out as the Hub cache (HF_HOME, offline).

The server speaks the endpoints huggingface_hub's snapshot_download uses: model info at a
revision, the recursive tree listing, and HEAD/GET on resolve URLs with ETag and X-Repo-Commit
headers and byte ranges (for resumed downloads).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.helpers import REPO, trainer_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "tiny-org/tiny-model"


def safetensors_bytes(tensors: dict[str, tuple[int, ...]], fill: int) -> bytes:
    """A valid safetensors file of float32 tensors, built by hand (no torch import)."""
    header, offset, payload = {}, 0, b""
    for name, shape in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        data = struct.pack("<f", fill / 7.0) * count
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        payload += data
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + payload


def tiny_repo(rows: int = 64) -> dict[str, bytes]:
    """Config, a two-shard index, tokenizer: the layout of a real sharded model repository."""
    shard1 = safetensors_bytes({"model.embed_tokens.weight": (64, 32)}, 1)
    shard2 = safetensors_bytes({"lm_head.weight": (rows, 32), "model.norm.weight": (32,)}, 2)
    index = {
        "metadata": {"total_size": len(shard1) + len(shard2)},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    llama = REPO / "configs" / "tiny-llama"
    return {
        "config.json": (llama / "config.json").read_bytes(),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": shard1,
        "model-00002-of-00002.safetensors": shard2,
        "tokenizer.json": (llama / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": (llama / "tokenizer_config.json").read_bytes(),
    }


class FakeHub:
    """A threaded HTTP server answering the Hub's model-info, tree and resolve endpoints for one repo."""

    def __init__(self, files: dict[str, bytes], token: str | None = None, drop_once: set[str] = frozenset()):
        self.files = files
        self.token = token
        self.drop_once = set(drop_once)  # files whose first GET breaks off 1000 bytes short
        self.requests: list[tuple[str, str, dict]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def paths_requested(self, method: str) -> list[str]:
        return [path for m, path, _ in self.requests if m == method]

    def reply(self, handler, status: int, body: bytes = b"", headers: dict | None = None, head=False):
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, str(value))
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def not_found(self, handler, code: str, head: bool):
        self.reply(handler, 404, b"{}", {"X-Error-Code": code, "X-Error-Message": code}, head)

    def handle(self, handler, head: bool):
        url = urlparse(handler.path)
        path = unquote(url.path)
        self.requests.append(
            ("HEAD" if head else "GET", path, {k.lower(): v for k, v in handler.headers.items()})
        )
        if self.token and handler.headers.get("Authorization") != f"Bearer {self.token}":
            return self.reply(handler, 401, b"{}", {"X-Error-Message": "Invalid credentials"}, head)
        model_api = f"/api/models/{REPO_ID}"
        if path == f"{model_api}/revision/main" or path == f"{model_api}/revision/{COMMIT}":
            body = json.dumps(
                {"id": REPO_ID, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self.files]}
            )
            return self.reply(handler, 200, body.encode(), {"Content-Type": "application/json"}, head)
        if path.startswith(f"{model_api}/revision/"):
            return self.not_found(handler, "RevisionNotFound", head)
        if path == f"{model_api}/tree/{COMMIT}":
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            return self.reply(
                handler, 200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, head
            )
        prefix = f"/{REPO_ID}/resolve/"
        if path.startswith(prefix):
            revision, _, name = path[len(prefix) :].partition("/")
            if revision not in ("main", COMMIT) or name not in self.files:
                return self.not_found(handler, "EntryNotFound", head)
            data = self.files[name]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT}
            ranged = handler.headers.get("Range", "")
            if ranged.startswith("bytes=") and not head:
                start = int(ranged[len("bytes=") :].split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self.reply(handler, 206, data[start:], headers)
            if head:
                handler.send_response(200)
                for key, value in headers.items():
                    handler.send_header(key, value)
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                return None
            if name in self.drop_once:
                self.drop_once.discard(name)
                handler.send_response(200)
                for key, value in headers.items():
                    handler.send_header(key, value)
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data[: len(data) - 1000])
                handler.wfile.flush()
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)
                return None
            return self.reply(handler, 200, data, headers)
        return self.not_found(handler, "RepoNotFound", head)


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
    from trainer import hub

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
