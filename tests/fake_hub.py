"""A local fake of the Hugging Face Hub: just enough HTTP for huggingface_hub 2.x to download from it.

Two real HTTP/1.1 servers on 127.0.0.1 (``http.server``, one thread per connection):

- the *hub* (``endpoint``) answers what huggingface_hub requests:
  ``GET /api/{models,datasets}/{repo}[/revision/{rev}]`` (repo info with ``sha`` and ``siblings`` carrying
  size, blobId and lfs), ``GET /api/{type}s/{repo}/tree/{rev}`` (one page), and ``HEAD``/``GET
  /[datasets/]{repo}/resolve/{rev}/{path}``. Small files are served directly with ``ETag`` (git blob id),
  ``X-Repo-Commit`` and ``Content-Length``; LFS files (``*.safetensors``, ``*.bin``) answer ``302`` with
  ``X-Linked-Etag`` (sha256), ``X-Linked-Size`` and a ``Location`` on the CDN, like the real Hub.
- the *CDN* (another port, so another origin: huggingface_hub drops the token before following) serves
  ``GET``/``HEAD /cdn/{sha256}`` without auth.

Both honour ``Range: bytes=a-[b]`` (206 + ``Content-Range``; 416 past the end). Errors carry
``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) so the library raises its
typed errors. A gated repo wants ``Authorization: Bearer <token>`` on ``resolve`` (401 without, 403 with a
wrong one); its info stays public, as on the Hub.

Test switches: ``cut_next(path, after_bytes)`` drops the next transfer of ``path`` after that many body
bytes (the client sees the connection close mid-body); ``chunk_delay`` slows every transfer. Every request
is recorded (``requests``) with the body bytes actually written, for "was it fetched, how much, with which
Range" assertions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
SEND_CHUNK = 16 * 1024
_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class FakeFile:
    data: bytes
    lfs: bool

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class FakeRepo:
    repo_id: str
    repo_type: str = "model"
    commits: dict[str, dict[str, FakeFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


@dataclass
class Request:
    method: str
    server: str  # "hub" or "cdn"
    path: str  # url path, unquoted
    file: str | None  # repo file served (resolve or cdn), if any
    range: str | None
    authorization: str | None
    status: int = 0
    sent: int = 0  # body bytes written to the socket


class FakeHub:
    """Start with ``start()`` (or use as a context manager); ``endpoint`` is the base url to pass."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], FakeRepo] = {}
        self.requests: list[Request] = []
        self.chunk_delay = 0.0
        self._cuts: dict[str, int] = {}
        self._cdn_files: dict[str, tuple[FakeFile, str]] = {}
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()
        self.endpoint = ""
        self.cdn_base = ""

    # --- content ---------------------------------------------------------------------------------------

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        refs: tuple[str, ...] = ("main",),
        repo_type: str = "model",
    ) -> str:
        """Add a commit holding exactly ``files``; point ``refs`` (branches/tags) at it; return its sha."""
        repo = self.repos.setdefault((repo_type, repo_id), FakeRepo(repo_id, repo_type))
        fake = {path: FakeFile(data, path.endswith(LFS_SUFFIXES)) for path, data in files.items()}
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(fake):
            digest.update(f"{path}\0{fake[path].blob_id}\0".encode())
        digest.update(str(len(repo.commits)).encode())
        sha = digest.hexdigest()
        with self._lock:
            repo.commits[sha] = fake
            for ref in refs:
                repo.refs[ref] = sha
            for path, f in fake.items():
                if f.lfs:
                    self._cdn_files.setdefault(f.sha256, (f, path))
        return sha

    def add_commit_from_dir(self, repo_id: str, root: Path, **kwargs: object) -> str:
        files = {
            p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }
        return self.add_commit(repo_id, files, **kwargs)  # type: ignore[arg-type]

    def gate(self, repo_id: str, token: str, repo_type: str = "model") -> None:
        self.repos[(repo_type, repo_id)].gated_token = token

    # --- switches and counters -------------------------------------------------------------------------

    def cut_next(self, path: str, after_bytes: int) -> None:
        """Close the connection after ``after_bytes`` body bytes of the next transfer of ``path``."""
        with self._lock:
            self._cuts[path] = after_bytes

    def reset_stats(self) -> None:
        with self._lock:
            self.requests.clear()

    def transfers(self, path: str | None = None) -> list[Request]:
        """GET requests that sent (part of) a file's body, optionally of one repo path."""
        with self._lock:
            return [
                r for r in self.requests if r.method == "GET" and r.file and (path is None or r.file == path)
            ]

    def bytes_served(self, path: str | None = None) -> int:
        return sum(r.sent for r in self.transfers(path))

    def touched(self, path: str) -> bool:
        """Whether any request (HEAD included) named this repo file."""
        with self._lock:
            return any(r.file == path for r in self.requests)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> FakeHub:
        for role in ("hub", "cdn"):
            server = _Server(("127.0.0.1", 0), _Handler)
            server.hub = self
            server.role = role
            base = f"http://127.0.0.1:{server.server_address[1]}"
            if role == "hub":
                self.endpoint = base
            else:
                self.cdn_base = base
            thread = threading.Thread(
                target=server.serve_forever, args=(0.05,), name=f"fake-{role}", daemon=True
            )
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop listening and drop open keep-alive connections, so the endpoint becomes unreachable."""
        for server in self._servers:
            server.shutdown()
            server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: FakeHub
    role: str


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep pytest output clean

    def setup(self) -> None:
        super().setup()
        with self.server.hub._lock:
            self.server.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.hub._lock:
            self.server.hub._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def do_GET(self) -> None:
        self._dispatch(body=True)

    # --- routing ---------------------------------------------------------------------------------------

    def _dispatch(self, *, body: bool) -> None:
        hub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        record = Request(
            self.command,
            self.server.role,
            path,
            None,
            self.headers.get("Range"),
            self.headers.get("Authorization"),
        )
        with hub._lock:
            hub.requests.append(record)
        try:
            if self.server.role == "cdn":
                self._cdn(record, body)
            elif path.startswith("/api/"):
                self._api(record, path[len("/api/") :])
            else:
                self._resolve(record, path.lstrip("/"), body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _api(self, record: Request, rest: str) -> None:
        kind, _, rest = rest.partition("/")
        repo_type = kind[:-1] if kind in ("models", "datasets") else kind
        if "/tree/" in rest:
            repo_part, _, revision = rest.partition("/tree/")
            action = "tree"
        elif "/revision/" in rest:
            repo_part, _, revision = rest.partition("/revision/")
            action = "info"
        else:
            repo_part, revision, action = rest, "main", "info"
        repo = self.server.hub.repos.get((repo_type, repo_part))
        if repo is None:
            return self._error(record, 404, "RepoNotFound", "Repository not found")
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(record, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        if action == "tree":
            payload: object = [
                {
                    "type": "file",
                    "oid": f.blob_id,
                    "size": len(f.data),
                    "path": name,
                    **({"lfs": {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}} if f.lfs else {}),
                }
                for name, f in sorted(files.items())
            ]
        else:
            payload = {
                "id": repo.repo_id,
                "sha": sha,
                "private": False,
                "gated": "manual" if repo.gated_token else False,
                "siblings": [
                    {
                        "rfilename": name,
                        "size": len(f.data),
                        "blobId": f.blob_id,
                        **(
                            {"lfs": {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}}
                            if f.lfs
                            else {}
                        ),
                    }
                    for name, f in sorted(files.items())
                ],
            }
        data = json.dumps(payload).encode()
        record.status = 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _resolve(self, record: Request, rest: str, body: bool) -> None:
        repo_type = "model"
        if rest.startswith("datasets/"):
            repo_type, rest = "dataset", rest[len("datasets/") :]
        repo_part, sep, tail = rest.partition("/resolve/")
        revision, _, name = tail.partition("/")
        repo = self.server.hub.repos.get((repo_type, repo_part)) if sep else None
        if repo is None:
            return self._error(record, 404, "RepoNotFound", "Repository not found")
        record.file = name
        if repo.gated_token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:
                return self._error(record, 401, "GatedRepo", f"Access to model {repo.repo_id} is restricted.")
            if auth != f"Bearer {repo.gated_token}":
                return self._error(record, 403, "GatedRepo", f"Access to model {repo.repo_id} is restricted.")
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(record, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        fake = repo.commits[sha].get(name)
        if fake is None:
            return self._error(record, 404, "EntryNotFound", f"{name} does not exist", {"X-Repo-Commit": sha})
        if fake.lfs:
            record.status = 302
            self.send_response(302)
            self.send_header("Location", f"{self.server.hub.cdn_base}/cdn/{fake.sha256}")
            self.send_header("ETag", f'"{fake.blob_id}"')
            self.send_header("X-Linked-Etag", f'"{fake.sha256}"')
            self.send_header("X-Linked-Size", str(len(fake.data)))
            self.send_header("X-Repo-Commit", sha)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return self._send_file(record, fake.data, body, {"ETag": f'"{fake.blob_id}"', "X-Repo-Commit": sha})

    def _cdn(self, record: Request, body: bool) -> None:
        sha256 = record.path.removeprefix("/cdn/")
        with self.server.hub._lock:
            entry = self.server.hub._cdn_files.get(sha256)
        if entry is None:
            return self._error(record, 404, None, "no such object")
        fake, name = entry
        record.file = name
        return self._send_file(record, fake.data, body, {"ETag": f'"{fake.sha256}"'})

    # --- responses -------------------------------------------------------------------------------------

    def _send_file(self, record: Request, data: bytes, body: bool, headers: dict[str, str]) -> None:
        total = len(data)
        start, end = 0, total - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header:
            match = _RANGE_RE.match(range_header.strip())
            if match is None:
                return self._error(record, 400, None, f"bad range {range_header}")
            start = int(match.group(1))
            end = min(int(match.group(2)), total - 1) if match.group(2) else total - 1
            if start >= total:
                record.status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            status = 206
        record.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        self.end_headers()
        if not body:
            return None
        hub = self.server.hub
        with hub._lock:
            cut = hub._cuts.pop(record.file, None) if record.file else None
        limit = end + 1 if cut is None else min(end + 1, start + cut)
        position = start
        while position < limit:
            chunk = data[position : min(position + SEND_CHUNK, limit)]
            self.wfile.write(chunk)
            position += len(chunk)
            with hub._lock:
                record.sent += len(chunk)
            if hub.chunk_delay:
                time.sleep(hub.chunk_delay)
        if cut is not None and limit <= end:
            # Promised more than it sends: the client sees the connection close mid-body.
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        return None

    def _error(
        self,
        record: Request,
        status: int,
        code: str | None,
        message: str,
        extra: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps({"error": message}).encode()
        record.status = status
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
