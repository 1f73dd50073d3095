"""A TCP proxy on loopback that counts what the upstream server sends, and paces it per connection (a CDN's
per-connection rate): what one client of a store fetched (`test_store_delta_server`), and a store at a
benchmark's rate (`benchmarks/bench_store_delta.py`). Requests pass through unchanged."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from tests.support.server_support import free_port


class ThrottleProxy:
    """`127.0.0.1:port` forwarding to UPSTREAM (host, port), each connection's replies paced to RATE bytes/s
    (None: as fast as they come).

    `sent` counts the reply bytes of every connection.
    """

    def __init__(self, upstream: tuple[str, int], rate: float | None = None) -> None:
        self.upstream, self.rate = upstream, rate
        self.port = free_port()
        self.sent = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closing = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThrottleProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        due = time.perf_counter()  # when the next byte may go: an idle connection saves no credit
        try:
            while chunk := source.recv(64 << 10):
                sink.sendall(chunk)
                if replies:
                    with self._lock:
                        self.sent += len(chunk)
                if replies and self.rate is not None:
                    due = max(due, time.perf_counter()) + len(chunk) / self.rate
                    wait = due - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
