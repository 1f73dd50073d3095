"""A loopback stand-in for the Hugging Face Hub that serves checkpoint folders to huggingface_hub."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

# Files the Hub stores with Git LFS (it answers with the LFS object's sha256 as ETag).
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
# Body bytes per write: small enough that a throttle paces smoothly and a drop lands mid-body.
_WRITE_BYTES = 16 << 10


@dataclass
class _Revision:
    commit: str
    folder: Path


@dataclass
class _Request:
    method: str
    path: str
    range: str | None
    status: int
    origin: str = "hub"  # "hub", or "cdn" for the storage origin
    authorization: bool = False  # whether the request carried an Authorization header
    sent: int = 0  # body bytes sent


@dataclass
class Fault:
    """What the server does to the next `times` GETs of a file's bytes (where the bytes are served).

    `kind`: "status" answers `status` (with `Retry-After` when set) instead of the bytes; "drop" sends
    `after_bytes` of the body and closes the connection; "stall" sends `after_bytes`, then nothing for
    `stall_s` seconds before closing; "corrupt" sends the bytes with the first one flipped.
    """

    filename: str
    kind: str
    times: int = 1
    status: int = 503
    retry_after: int | None = None
    after_bytes: int = 0
    stall_s: float = 30.0


@dataclass
class HubServer:
    """Serve folders as Hub model repos on 127.0.0.1 (an automatic port).

    It answers the requests huggingface_hub 2.x makes when `HF_ENDPOINT` points
    at it: model info (`/api/models/{repo}[/revision/{rev}]`), the file tree
    (`/api/models/{repo}/tree/{rev}`), and `HEAD`/`GET /{repo}/resolve/{rev}/{file}`
    with the headers it reads (`X-Repo-Commit`, `ETag`, `X-Linked-Etag`,
    `X-Linked-Size`, `Content-Length`, `Accept-Ranges`), byte ranges (206, 416),
    and the Hub's `X-Error-Code` on 404s (`RepoNotFound`, `RevisionNotFound`,
    `EntryNotFound`). It counts the body bytes it sends, per path, so that a
    test can prove what was (not) downloaded.

    It also answers `/api/agent-harnesses`, the registry huggingface_hub 2.4+
    reads once a day to build its user agent (`utils/_detect_agent.py`), with
    the empty registry. That request is the client's own, not traffic to a
    repo: it is counted in `registry_reads`, not in `requests` or `bytes_sent`.

    For the faults a fetch must survive: `throttle_bps` paces each connection;
    `cdn=True` serves LFS bytes from a second origin (its own port) behind a
    302 with expiring URLs, and records whether each request carried an
    `Authorization` header; `faults` answer 429/5xx, drop a connection
    mid-body, or stall; `move_ref` pushes a new commit to a branch (from
    `on_request`, in the middle of an operation) and `forget_commit` removes
    one (a force-push).

    Use `add_repo` for each repo and revision, then `start()` (or `with`).
    `endpoint` is the value for `HF_ENDPOINT`.
    """

    repos: dict[str, dict[str, _Revision]] = field(default_factory=dict)
    # repo id -> HTTP status to answer for its weight files (a Hub having a bad day
    # with its storage backend; small files still come through).
    failing: dict[str, int] = field(default_factory=dict)
    # Every request answers this HTTP status (the whole Hub down behind its load balancer); None: serve.
    outage: int | None = None
    # As the Hub does: answer /resolve/ of LFS files with a 302 to a storage
    # URL (here /cdn/... on the same server) that serves the bytes.
    redirect_lfs: bool = False
    # Repo ids whose files are served whole whatever the Range header says (a bad mirror).
    ignore_ranges: set[str] = field(default_factory=set)
    # A second origin on its own port acting as the storage CDN: /resolve/ of LFS files answers a 302 to it
    # (cross-origin, so a client must not send the token there), with URLs that expire after `cdn_ttl_s`.
    cdn: bool = False
    cdn_ttl_s: float = 3600.0
    # Each connection's body writes are paced to this many bytes per second (a CDN's per-connection limit).
    throttle_bps: int | None = None
    faults: list[Fault] = field(default_factory=list)
    # Called with each request once it is answered (a test moves a ref from here, mid-operation).
    on_request: Callable[[_Request], None] | None = None
    # Called with a file's path in the repo and the Range header (None: the whole file) before its bytes are
    # sent, in the request's own thread (a test holds one download until another has begun).
    before_body: Callable[[str, str | None], None] | None = None
    bytes_sent: Counter = field(default_factory=Counter)  # URL path -> body bytes sent
    requests: list[_Request] = field(default_factory=list)
    registry_reads: int = 0  # GET /api/agent-harnesses (huggingface_hub's user agent), left out of `requests`
    # repo id -> every commit ever served (a moved ref leaves its old commit reachable by id, as on the Hub).
    commits: dict[str, dict[str, _Revision]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pushes: int = field(default=0, repr=False)
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _cdn_server: ThreadingHTTPServer | None = field(default=None, repr=False)

    def add_repo(self, repo_id: str, folder: str | Path, revision: str = "main") -> str:
        """Serve `folder` as `repo_id` at branch `revision`; return the revision's commit hash."""
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        return self._point(repo_id, revision, _Revision(commit, Path(folder)))

    def move_ref(self, repo_id: str, revision: str, folder: str | Path) -> str:
        """Point branch `revision` at a new commit serving `folder` (a push); the old commit stays reachable."""
        with self._lock:
            # Never reused: a push after `forget_commit` gets a commit of its own.
            self._pushes += 1
            n = self._pushes
        commit = hashlib.sha1(f"{repo_id}@{revision}#{n}".encode()).hexdigest()
        return self._point(repo_id, revision, _Revision(commit, Path(folder)))

    def forget_commit(self, repo_id: str, commit: str) -> None:
        """The commit is gone (a force-push, a squash): requests naming it answer RevisionNotFound."""
        with self._lock:
            self.commits.get(repo_id, {}).pop(commit, None)

    def _point(self, repo_id: str, revision: str, target: _Revision) -> str:
        with self._lock:
            self.repos.setdefault(repo_id, {})[revision] = target
            self.commits.setdefault(repo_id, {})[target.commit] = target
        return target.commit

    def start(self) -> Self:
        self._server, self._thread = _serve(_make_handler(self, storage_only=False), "hub-server")
        if self.cdn:
            self._cdn_server, _ = _serve(_make_handler(self, storage_only=True), "hub-cdn")
        return self

    def stop(self) -> None:
        for server in (self._cdn_server, self._server):
            if server is not None:
                server.shutdown()
                server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._cdn_server = self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the server first"
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_endpoint(self) -> str:
        assert self._cdn_server is not None, "HubServer(cdn=True), started"
        return f"http://127.0.0.1:{self._cdn_server.server_address[1]}"

    def sent_for(self, suffix: str) -> int:
        """Body bytes sent for paths ending with `suffix` (e.g. `.safetensors`)."""
        with self._lock:
            return sum(n for path, n in self.bytes_sent.items() if path.endswith(suffix))

    def sent_for_file(self, filename: str) -> int:
        """Body bytes of `filename` sent from either origin (its `/resolve/` and `/cdn/` paths)."""
        with self._lock:
            return sum(n for path, n in self.bytes_sent.items() if path.endswith("/" + filename))

    def reset_counts(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()

    # Lookups used by the handler.

    def resolve(self, repo_id: str, revision: str) -> _Revision | None:
        with self._lock:
            revisions = self.repos.get(repo_id, {})
            if revision in revisions:
                return revisions[revision]
            return self.commits.get(repo_id, {}).get(revision)

    def take_fault(self, filename: str) -> Fault | None:
        """The first fault still armed for `filename`, used once."""
        with self._lock:
            for fault in self.faults:
                if fault.filename == filename and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    def _record(self, request: _Request) -> None:
        with self._lock:
            self.requests.append(request)
            self.bytes_sent[request.path] += request.sent
        if self.on_request is not None:
            self.on_request(request)


def once_named(hub: HubServer, text: str, then: Callable[[], object]) -> None:
    """Call THEN once, after the first request whose path names TEXT (a commit: the operation pinned it).

    Sets `hub.on_request`: `once_named(hub, commit, lambda: hub.move_ref(repo, "main", other))` moves a branch
    in the middle of an operation, just after its first read of the commit the branch named at its start.
    """
    lock, done = threading.Lock(), []

    def on_request(request: _Request) -> None:
        with lock:
            if done or text not in request.path:
                return
            done.append(request.path)
        then()

    hub.on_request = on_request


def _serve(handler: type[BaseHTTPRequestHandler], name: str) -> tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return server, thread


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _etag(path: Path) -> str:
    stat = path.stat()
    return _etag_of(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _etag_of(path: str, _mtime_ns: int, _size: int) -> str:
    data = Path(path).read_bytes()
    if path.endswith(_LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def _make_handler(hub: HubServer, *, storage_only: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's client expects
        # Headers and body go out in two writes: without TCP_NODELAY, Nagle's
        # algorithm and delayed ACKs stall every kept-alive response by ~40 ms.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep test output clean

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # Routing: split the raw path before unquoting, since a revision may
        # hold an escaped "/" (refs%2Fpr%2F1).

        def _route(self, head: bool) -> None:
            if urlsplit(self.path).path == "/api/agent-harnesses" and not storage_only:
                return self._agent_registry(head)  # before `outage`: the client's own read, not under test
            if hub.outage is not None:
                return self._error(hub.outage, None, f"outage: HTTP {hub.outage}", head)
            raw_path = urlsplit(self.path).path
            parts = raw_path.split("/")[1:]
            if storage_only and not (len(parts) >= 5 and parts[0] == "cdn"):
                return self._error(404, None, "Not Found", head)
            if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
                repo_id = f"{unquote(parts[2])}/{unquote(parts[3])}"
                rest = parts[4:]
                if not rest:
                    return self._model_info(repo_id, "main", head)
                if rest[0] == "revision" and len(rest) == 2:
                    return self._model_info(repo_id, unquote(rest[1]), head)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo_id, unquote(rest[1]), head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
                filename = unquote("/".join(parts[4:]))
                return self._resolve(repo_id, unquote(parts[3]), filename, head)
            if len(parts) >= 5 and parts[0] == "cdn":  # /cdn/{org}/{name}/{commit}/{file}[?expires=T]
                repo_id = f"{unquote(parts[1])}/{unquote(parts[2])}"
                expires = parse_qs(urlsplit(self.path).query).get("expires", [""])[0]
                if expires and float(expires) < time.time():
                    return self._error(403, None, "Request has expired", head)
                return self._resolve(repo_id, parts[3], unquote("/".join(parts[4:])), head, storage=True)
            self._error(404, None, "Not Found", head)

        def _lookup(self, repo_id: str, revision: str, head: bool) -> _Revision | None:
            if repo_id not in hub.repos:
                self._error(404, "RepoNotFound", "Repository not found", head)
                return None
            found = hub.resolve(repo_id, revision)
            if found is None:
                self._error(404, "RevisionNotFound", "Invalid rev id: " + revision, head)
            return found

        def _model_info(self, repo_id: str, revision: str, head: bool) -> None:
            found = self._lookup(repo_id, revision, head)
            if found is None:
                return
            siblings = [{"rfilename": p.relative_to(found.folder).as_posix()} for p in _files(found.folder)]
            info = {"id": repo_id, "modelId": repo_id, "sha": found.commit, "private": False,
                    "gated": False, "disabled": False, "siblings": siblings}
            self._json(info, head, commit=found.commit)

        def _tree(self, repo_id: str, revision: str, head: bool) -> None:
            found = self._lookup(repo_id, revision, head)
            if found is None:
                return
            entries = []
            for p in _files(found.folder):
                size = p.stat().st_size
                lfs = p.name.endswith(_LFS_SUFFIXES)
                # For an LFS file the Hub's oid is that of the small pointer file; any stable id will do here.
                oid = hashlib.sha1(p.name.encode()).hexdigest() if lfs else _etag(p)
                entry: dict[str, object] = {"type": "file", "path": p.relative_to(found.folder).as_posix(),
                                            "size": size, "oid": oid}
                if lfs:
                    entry["lfs"] = {"oid": _etag(p), "size": size, "pointerSize": 134}
                entries.append(entry)
            self._json(entries, head, commit=found.commit)

        def _resolve(self, repo_id: str, revision: str, filename: str, head: bool, storage: bool = False) -> None:
            found = self._lookup(repo_id, revision, head)
            if found is None:
                return
            if repo_id in hub.failing and filename.endswith(_LFS_SUFFIXES):
                return self._error(hub.failing[repo_id], None, "Internal Error - We're working hard to fix this", head)
            path = (found.folder / filename).resolve()
            if not filename or not path.is_file() or found.folder.resolve() not in path.parents:
                return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{revision}\"", head,
                                   commit=found.commit)
            size = path.stat().st_size
            etag = _etag(path)
            headers = {"X-Repo-Commit": found.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if path.name.endswith(_LFS_SUFFIXES):
                headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)}
                if (hub.redirect_lfs or hub.cdn) and not storage:
                    location = f"/cdn/{quote(repo_id)}/{found.commit}/{quote(filename)}"
                    if hub.cdn:
                        location = f"{hub.cdn_endpoint}{location}?expires={time.time() + hub.cdn_ttl_s:.3f}"
                    return self._send(302, {**headers, "Location": location}, b"", content_length=0, head=head)
            fault = None if head else hub.take_fault(filename)
            if fault is not None and fault.kind == "status":
                extra = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                return self._error(fault.status, None, f"fault injected: HTTP {fault.status}", head, extra=extra)
            start, end, status = 0, size - 1, 200
            range_header = self.headers.get("Range")
            if range_header and not head and repo_id not in hub.ignore_ranges:
                match = _RANGE_RE.match(range_header.strip())
                if not match or (not match.group(1) and not match.group(2)):
                    return self._error(416, None, "Invalid range", head, extra={"Content-Range": f"bytes */{size}"})
                if match.group(1):
                    start = int(match.group(1))
                    end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
                else:  # "bytes=-N": the last N bytes
                    start = max(0, size - int(match.group(2)))
                if start >= size or start > end:
                    return self._error(416, None, "Range Not Satisfiable", head,
                                       extra={"Content-Range": f"bytes */{size}"})
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            length = max(0, end - start + 1)
            body = b""
            if not head and hub.before_body is not None:
                hub.before_body(filename, range_header)
            if not head:
                with open(path, "rb") as f:
                    f.seek(start)
                    body = f.read(length)
            self._send(status, headers, body, content_length=length, head=head, fault=fault)

        def _agent_registry(self, head: bool) -> None:
            with hub._lock:
                hub.registry_reads += 1
            body = json.dumps({"standardEnvVars": [], "harnesses": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, doc: object, head: bool, commit: str | None = None) -> None:
            body = json.dumps(doc).encode()
            headers = {"Content-Type": "application/json"}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(200, headers, body, content_length=len(body), head=head)

        def _error(self, status: int, code: str | None, message: str, head: bool, commit: str | None = None,
                   extra: dict[str, str] | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, headers, body, content_length=len(body), head=head)

        def _send(self, status: int, headers: dict[str, str], body: bytes, *, content_length: int,
                  head: bool, fault: Fault | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(content_length))
            self.end_headers()
            sent = 0
            if fault is not None and fault.kind == "corrupt" and body:
                body, fault = bytes([body[0] ^ 0xFF]) + body[1:], None
            if not head and body:
                cut = len(body) if fault is None else min(fault.after_bytes, len(body))
                sent = self._write_paced(body[:cut])
                if fault is not None:
                    if fault.kind == "stall":
                        time.sleep(fault.stall_s)
                    self._drop()
            request = _Request(self.command, urlsplit(self.path).path, self.headers.get("Range"), status,
                               "cdn" if storage_only else "hub", "authorization" in self.headers, sent)
            hub._record(request)

        def _write_paced(self, body: bytes) -> int:
            """Write `body` in small pieces, no faster than the throttle; return the bytes written."""
            sent, began = 0, time.monotonic()
            try:
                for offset in range(0, len(body), _WRITE_BYTES):
                    piece = body[offset:offset + _WRITE_BYTES]
                    self.wfile.write(piece)
                    sent += len(piece)
                    if hub.throttle_bps:
                        time.sleep(max(0.0, began + sent / hub.throttle_bps - time.monotonic()))
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            return sent

        def _drop(self) -> None:
            # Mid-body: the client sees a body shorter than its Content-Length.
            self.close_connection = True
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    return Handler
