"""A local HTTP server that answers like the Hugging Face Hub, for huggingface_hub pointed at it
through HF_ENDPOINT: model info at a revision, the recursive tree listing, HEAD/GET on resolve URLs
(ETag, X-Repo-Commit, byte ranges), and the create-repo / preupload / commit calls of an upload.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

from tests.helpers import REPO

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
        self.created: list[dict] = []  # create-repo payloads
        self.commits: list[dict] = []  # {"repo", "summary", "files": {path: bytes}}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

            def do_POST(self):
                hub.handle_post(self)

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

    def handle_post(self, handler):
        """The upload side: create a repo, say every file uploads inline ("regular"), take the commit."""
        path = unquote(urlparse(handler.path).path)
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if handler.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        self.requests.append(("POST", path, headers))
        if self.token and headers.get("authorization") != f"Bearer {self.token}":
            return self.reply(handler, 401, b"{}", {"X-Error-Message": "Invalid credentials"})
        if path == "/api/repos/create":
            payload = json.loads(body)
            self.created.append(payload)
            repo = f"{payload.get('organization')}/{payload['name']}"
            return self.reply(handler, 200, json.dumps({"url": f"{self.url}/{repo}", "name": repo}).encode())
        if path == "/api/validate-yaml":
            return self.reply(handler, 200, b'{"errors": [], "warnings": []}')
        if path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(body)["files"]
            listing = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return self.reply(handler, 200, json.dumps({"files": listing}).encode())
        if path.startswith("/api/models/") and "/commit/" in path:
            repo = path[len("/api/models/") :].split("/commit/")[0]
            commit = {"repo": repo, "files": {}}
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    commit["summary"] = item["value"]["summary"]
                elif item["key"] == "file":
                    commit["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            self.commits.append(commit)
            oid = hashlib.sha1(body).hexdigest()
            reply = {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
            return self.reply(handler, 200, json.dumps(reply).encode())
        return self.not_found(handler, "RepoNotFound", False)
