"""A loopback stand-in for the Hugging Face Hub that serves checkpoint folders to huggingface_hub."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import quote, unquote, urlsplit

# Files the Hub stores with Git LFS (it answers with the LFS object's sha256 as ETag).
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


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

    Use `add_repo` for each repo and revision, then `start()` (or `with`).
    `endpoint` is the value for `HF_ENDPOINT`.
    """

    repos: dict[str, dict[str, _Revision]] = field(default_factory=dict)
    # repo id -> HTTP status to answer for its weight files (a Hub having a bad day
    # with its storage backend; small files still come through).
    failing: dict[str, int] = field(default_factory=dict)
    # As the Hub does: answer /resolve/ of LFS files with a 302 to a storage
    # URL (here /cdn/... on the same server) that serves the bytes.
    redirect_lfs: bool = False
    # Repo ids whose files are served whole whatever the Range header says (a bad mirror).
    ignore_ranges: set[str] = field(default_factory=set)
    bytes_sent: Counter = field(default_factory=Counter)  # URL path -> body bytes sent
    requests: list[_Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def add_repo(self, repo_id: str, folder: str | Path, revision: str = "main") -> str:
        """Serve `folder` as `repo_id` at branch `revision`; return the revision's commit hash."""
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        self.repos.setdefault(repo_id, {})[revision] = _Revision(commit, Path(folder))
        return commit

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=5)
            self._server = None

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

    def sent_for(self, suffix: str) -> int:
        """Body bytes sent for paths ending with `suffix` (e.g. `.safetensors`)."""
        with self._lock:
            return sum(n for path, n in self.bytes_sent.items() if path.endswith(suffix))

    def reset_counts(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()

    # Lookups used by the handler.

    def resolve(self, repo_id: str, revision: str) -> _Revision | None:
        revisions = self.repos.get(repo_id, {})
        if revision in revisions:
            return revisions[revision]
        return next((r for r in revisions.values() if r.commit == revision), None)

    def _record(self, method: str, path: str, range_: str | None, status: int, body_bytes: int) -> None:
        with self._lock:
            self.requests.append(_Request(method, path, range_, status))
            self.bytes_sent[path] += body_bytes


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


def _make_handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
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
            raw_path = urlsplit(self.path).path
            parts = raw_path.split("/")[1:]
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
            if len(parts) >= 5 and parts[0] == "cdn":  # /cdn/{org}/{name}/{commit}/{file}
                repo_id = f"{unquote(parts[1])}/{unquote(parts[2])}"
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
                if hub.redirect_lfs and not storage:
                    location = f"/cdn/{quote(repo_id)}/{found.commit}/{quote(filename)}"
                    return self._send(302, {**headers, "Location": location}, b"", content_length=0, head=head)
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
            if not head:
                with open(path, "rb") as f:
                    f.seek(start)
                    body = f.read(length)
            self._send(status, headers, body, content_length=length, head=head)

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
                  head: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(content_length))
            self.end_headers()
            sent = 0
            if not head and body:
                try:
                    self.wfile.write(body)
                    sent = len(body)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
            hub._record(self.command, urlsplit(self.path).path, self.headers.get("Range"), status, sent)

    return Handler
