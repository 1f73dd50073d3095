"""A plain HTTPS file server for tests: a folder served with byte ranges, ETags and If-Match, on loopback.

Its certificate comes from a throwaway certificate authority (`trustme`); `ca_file` is what a client trusts
(layerwise reads it from `SSL_CERT_FILE`). `sent` counts the body bytes each file sent. `stalls` makes a file's
body stall: name -> the byte of the file at which every GET of it stops sending, holding the connection open
until the server closes (a stalled transfer, never a dropped one). `rewrites` rewrites a file in the middle of an
operation: name -> new bytes, written over the file just before the first GET of it that names the identity read
earlier (`If-Match`), which then finds the object changed.
"""

from __future__ import annotations

import hashlib
import re
import ssl
import tempfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class HttpsFolder:
    """Serve FOLDER's files at `https://127.0.0.1:PORT/<prefix>/<name>` with a certificate `ca_file` vouches for."""

    def __init__(self, folder: Path, prefix: str = "ckpt") -> None:
        import trustme  # noqa: PLC0415 - trustme: optional dependency (a dev tool)

        self.folder, self.prefix = folder, prefix
        self.sent: Counter[str] = Counter()
        self.stalls: dict[str, int] = {}
        self.rewrites: dict[str, bytes] = {}
        self._closing = threading.Event()
        authority = trustme.CA()
        self._tmp = tempfile.TemporaryDirectory(prefix="layerwise-https-")
        self.ca_file = Path(self._tmp.name) / "ca.pem"
        authority.cert_pem.write_to_path(str(self.ca_file))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        authority.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}/{prefix}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HttpsFolder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()  # a stalled body's handler ends
        self._server.shutdown()
        self._server.server_close()
        self._tmp.cleanup()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                name = self.path.split("?")[0].removeprefix(f"/{outer.prefix}/")
                path = outer.folder / name
                if "/" in name or not path.is_file():
                    return self._empty(404)
                wanted = self.headers.get("If-Match")
                if wanted and name in outer.rewrites:
                    path.write_bytes(outer.rewrites.pop(name))
                data = path.read_bytes()
                etag = '"' + hashlib.md5(data).hexdigest() + '"'
                if wanted and wanted not in ("*", etag):
                    return self._empty(412)
                status, start, end = 200, 0, len(data)
                match = _RANGE.match(self.headers.get("Range", ""))
                if match:
                    start = int(match.group(1))
                    end = min(len(data), int(match.group(2)) + 1) if match.group(2) else len(data)
                    if start >= len(data):
                        return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
                    status = 206
                self.send_response(status)
                self.send_header("ETag", etag)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Last-Modified", "Sat, 05 Dec 2026 08:00:00 GMT")
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if not head:
                    cut = min(end, max(start, outer.stalls.get(name, end)))
                    self.wfile.write(data[start:cut])
                    self.wfile.flush()
                    outer.sent[name] += cut - start
                    if cut < end:
                        outer._closing.wait()  # the rest never comes; the connection stays open
                        self.close_connection = True

            def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler
