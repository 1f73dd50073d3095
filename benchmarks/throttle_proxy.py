"""A TCP proxy on loopback that paces what the upstream server sends to each connection (a CDN's per-connection
rate), for the benchmarks of sources by URL (`bench_store_delta`). Requests pass through unchanged."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from tests.support.server_support import free_port


class ThrottleProxy:
    """`127.0.0.1:port` forwarding to UPSTREAM (host, port), each connection's replies paced to RATE bytes/s.

    `sent` counts the reply bytes of every connection.
    """

    def __init__(self, upstream: tuple[str, int], rate: float) -> None:
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
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.rate), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, rate: float | None) -> None:
        due = time.perf_counter()  # when the next byte may go: an idle connection saves no credit
        try:
            while chunk := source.recv(64 << 10):
                sink.sendall(chunk)
                if rate is not None:
                    with self._lock:
                        self.sent += len(chunk)
                    due = max(due, time.perf_counter()) + len(chunk) / rate
                    wait = due - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
