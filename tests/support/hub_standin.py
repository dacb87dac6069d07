"""A local stand-in for the HuggingFace hub's HTTP API, file-backed, for tests without network.

Serves the paths ``huggingface_hub`` calls to download (``GET /api/{models,datasets}/<repo>/revision/<rev>`` and
``.../tree/<rev>``, ``HEAD`` / ``GET /[datasets/]<repo>/resolve/<rev>/<file>``) from folders the test registers, those
its ``HfFileSystem`` calls to stream one (``datasets.load_dataset(<id>, streaming=True)``: ``.../tree/<rev>/<path>``
with or without ``recursive``, files and folders; ``POST .../paths-info/<rev>``; ``GET .../resolve/...`` with a
``Range`` header, answered 206 with that byte range), and takes uploads (``POST /api/repos/create``,
``/api/validate-yaml``, ``/preupload/``, ``/commit/``: each file inline). Every request is recorded with its
``Authorization`` and ``Range`` headers and every upload with its files, so a test can check what was fetched, how
often, with which token, and what was pushed. Point huggingface_hub at it with ``HF_ENDPOINT=<url>``
(our code reads it at call time).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

SHA = "0123456789abcdef0123456789abcdef01234567"  # the one commit every repo is at


class HubStandIn:
    """``with HubStandIn() as hub: hub.add("org/name", folder)``; ``hub.url`` is the endpoint."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Path] = {}  # (kind, repo id) -> folder
        self.requests: list[dict[str, Any]] = []
        self.uploads: list[dict[str, Any]] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, folder: Path, kind: str = "model") -> None:
        self.repos[(kind, repo_id)] = Path(folder)

    def fetched(self, suffix: str) -> int:
        """How many GET requests downloaded a path ending in ``suffix``."""
        return sum(1 for r in self.requests if r["method"] == "GET" and r["path"].endswith(suffix))

    def bytes_read(self, suffix: str = "") -> dict[str, int]:
        """The bytes of each file (a path ending in ``suffix``) that GET requests fetched, by path in the repo."""
        read: dict[str, int] = {}
        for r in self.requests:
            if r["method"] == "GET" and r.get("bytes") and r["path"].endswith(suffix):
                name = r["path"].split("/resolve/", 1)[-1].split("/", 1)[-1]
                read[name] = read.get(name, 0) + r["bytes"]
        return read

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _record(self) -> None:
        self.current = {
            "method": self.command,
            "path": unquote(self.path.split("?")[0]),
            "authorization": self.headers.get("Authorization"),
            "range": self.headers.get("Range"),
        }
        self.hub.requests.append(self.current)

    def do_HEAD(self) -> None:
        self._record()
        self._file(body=False)

    def do_POST(self) -> None:
        """Repo creation and commits (every file uploaded inline, "regular" mode: no LFS / Xet round trip)."""
        self._record()
        path = unquote(self.path.split("?")[0])
        body = self._body()
        if path == "/api/repos/create":
            request = json.loads(body or b"{}")
            repo_id = (
                f"{request.get('organization') or 'user'}/{request['name']}"
                if "/" not in request.get("name", "")
                else request["name"]
            )
            private = request.get(
                "private", request.get("visibility", "public") == "private"
            )  # huggingface_hub 0.x / 1+
            self.hub.uploads.append({"create": repo_id, "private": private})
            return self._send(200, json.dumps({"url": f"{self.hub.url}/{repo_id}"}).encode(), {})
        if "/paths-info/" in path:  # HfFileSystem.info: form fields paths=<p>&paths=<q>
            return self._paths_info(path, parse_qs(body.decode()).get("paths", []))
        if path == "/api/validate-yaml":  # a README.md's metadata block, checked before the commit
            return self._send(200, b'{"errors": [], "warnings": []}', {"Content-Type": "application/json"})
        if "/preupload/" in path:
            files = json.loads(body or b"{}").get("files", [])
            answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return self._send(200, json.dumps({"files": answer}).encode(), {"Content-Type": "application/json"})
        if "/commit/" in path:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            files = {}
            for line in lines:
                if line.get("key") == "file":
                    value = line["value"]
                    files[value["path"]] = (
                        base64.b64decode(value["content"])
                        if value.get("encoding") == "base64"
                        else value["content"].encode()
                    )
            repo_id = path.split("/api/models/")[-1].split("/commit/")[0]
            self.hub.uploads.append({"commit": repo_id, "files": files,
                                     "message": next((x["value"].get("summary") for x in lines
                                                      if x.get("key") == "header"), None)})  # fmt: skip
            answer = {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{SHA}", "commitOid": SHA}
            return self._send(200, json.dumps(answer).encode(), {"Content-Type": "application/json"})
        return self._send(404, b"not found", {})

    def do_GET(self) -> None:
        self._record()
        path = unquote(self.path.split("?")[0])
        if path.startswith("/api/"):
            self._info(path)
        else:
            self._file(body=True)

    def _body(self) -> bytes:
        """The request's body: by Content-Length, or chunked; gunzipped when sent compressed."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
        return gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body

    def _repo(self, parts: list[str], kind: str) -> tuple[str, Path] | None:
        for (k, repo_id), folder in self.hub.repos.items():
            if k == kind and "/".join(parts[: len(repo_id.split("/"))]) == repo_id:
                return repo_id, folder
        return None

    def _info(self, path: str) -> None:
        parts = path.split("/")[2:]  # models|datasets, org, name, revision|tree, <rev>[, <path in repo>...]
        kind = {"models": "model", "datasets": "dataset"}.get(parts[0])
        found = self._repo(parts[1:], kind) if kind else None
        if found is None:
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        repo_id, folder = found
        rest = parts[1 + len(repo_id.split("/")) :]
        if rest and rest[0] == "tree":  # /api/<kind>s/<repo>/tree/<rev>[/<path>]?recursive=...
            recursive = parse_qs(self.path.partition("?")[2]).get("recursive", ["False"])[0].lower() == "true"
            at = folder.joinpath(*rest[2:])
            if not at.is_dir():
                return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
            entries = sorted(at.rglob("*") if recursive else at.iterdir())
            body: Any = [_entry(folder, p) for p in entries]
        else:
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            siblings = [{"rfilename": str(f.relative_to(folder))} for f in files]
            body = {"id": repo_id, "sha": SHA, "siblings": siblings, "private": False}
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _paths_info(self, path: str, paths: list[str]) -> None:
        """``POST /api/<kind>s/<repo>/paths-info/<rev>``: the entries of those of ``paths`` that exist."""
        parts = path.split("/")[2:]
        kind = {"models": "model", "datasets": "dataset"}.get(parts[0])
        found = self._repo(parts[1:], kind) if kind else None
        if found is None:
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        entries = [_entry(found[1], found[1] / p) for p in paths if (found[1] / p).exists()]
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    def _file(self, body: bool) -> None:
        parts = unquote(self.path.split("?")[0]).strip("/").split("/")
        kind = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:] if kind == "dataset" else parts
        found = self._repo(parts, kind)
        if found is None or "resolve" not in parts:
            return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})
        at = parts.index("resolve")
        file = found[1] / "/".join(parts[at + 2 :])
        if not file.is_file():
            return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})
        data = file.read_bytes()
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        asked = self.headers.get("Range")
        if asked:  # bytes=<start>-[<end>] (inclusive), as HfFileSystem's reads ask
            start, _, end = asked.removeprefix("bytes=").partition("-")
            first, last = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
            if first >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            part = data[first : last + 1]
            headers.update({"Content-Range": f"bytes {first}-{last}/{len(data)}", "Content-Length": str(len(part))})
            return self._send(206, part if body else None, headers, length=len(part))
        headers["Content-Length"] = str(len(data))
        self._send(200, data if body else None, headers, length=len(data))

    def _send(self, code: int, data: bytes | None, headers: dict[str, str], length: int | None = None) -> None:
        if data is not None and self.command == "GET":
            self.current["bytes"] = len(data)  # what this request fetched
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(length if length is not None else len(data or b"")))
        self.end_headers()
        if data is not None and self.command != "HEAD":
            self.wfile.write(data)


def _entry(folder: Path, path: Path) -> dict[str, Any]:
    """A tree / paths-info entry of ``path`` (a file or a folder of the repo served from ``folder``)."""
    name = str(path.relative_to(folder))
    if path.is_dir():
        return {"type": "directory", "path": name, "oid": hashlib.sha1(name.encode()).hexdigest()}
    return {
        "type": "file",
        "path": name,
        "size": path.stat().st_size,
        "oid": hashlib.sha1(path.read_bytes()).hexdigest(),
    }
