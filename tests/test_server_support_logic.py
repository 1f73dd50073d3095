"""The test servers' start (`tests/support/server_support.RunningServer`): a port taken between choosing it and
binding it is chosen again on a first start, never on a restart (its clients know its URL)."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from tests.support.server_support import RunningServer

# A stand-in server: binds the port it is given (failing as any server does when it is taken) and answers /health.
_TINY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class Tiny(RunningServer):
    def command(self):
        return [sys.executable, "-c", _TINY, str(self.port)], dict(os.environ)


@pytest.fixture
def taken():
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


def _on(server: RunningServer, port: int) -> RunningServer:
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    return server


def test_a_first_start_on_a_taken_port_is_tried_again_on_another(taken):
    with _on(Tiny("model", start_timeout=30), taken) as server:
        assert server.port != taken and "Address already in use" in server.log_tail()


def test_a_restart_keeps_its_url_and_says_why_it_failed(taken):
    server = Tiny("model", start_timeout=30).start()
    try:
        server.stop()
        _on(server, taken)
        with pytest.raises(RuntimeError, match="exited with 1 before it was healthy"):
            server.start()
        assert server.port == taken
    finally:
        server.__exit__(None, None, None)  # stopped, its log removed
