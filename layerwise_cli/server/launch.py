"""The `layerwise serve` process: vLLM's OpenAI server, with every endpoint behind the API key when one is set.

Run as `python -m layerwise_cli.server.launch ARGS` (what `layerwise serve`
execs); it imports neither Typer nor Rich. With `--headless` in ARGS it runs
a follower node instead (`server/headless.py`): workers only, no server.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from layerwise_cli import vllm_compat
from layerwise_cli.engine_output import capture_engine_output, start_failure
from layerwise_cli.server.command_line import OPEN_PATHS
from layerwise_cli.server.engines_rpc import attach_engines_rpc
from layerwise_cli.server.follower_watch import NODE_LOST_NOTE_ENV

VLLM_SERVER_MODULE = vllm_compat.SERVER_MODULE_NAME


def _guard_every_endpoint() -> None:
    """Make vLLM's API-key check cover every path except `OPEN_PATHS` (vLLM's covers only /v1 and a few).

    vLLM adds its middleware only when a key is set (`--api-key` or
    VLLM_API_KEY), and imports the class when it adds it: replacing the
    class here, before the server starts, is enough.
    """
    authenticate = vllm_compat.authenticate_module()

    base = authenticate.AuthenticationMiddleware

    class GuardEveryEndpoint(base):  # type: ignore[misc, valid-type]
        def __call__(self, scope, receive, send):
            if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
                return self.app(scope, receive, send)
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in OPEN_PATHS and not self.verify_token(Headers(scope=scope)):
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return self.app(scope, receive, send)

    authenticate.AuthenticationMiddleware = GuardEveryEndpoint


@contextlib.contextmanager
def node_lost_note() -> Iterator[Path]:
    """A path, named to this server's engine processes, where node 0's engine core says a node was lost."""
    with tempfile.TemporaryDirectory(prefix="layerwise-serve-") as folder:
        note = Path(folder) / "node-lost"
        os.environ[NODE_LOST_NOTE_ENV] = str(note)
        try:
            yield note
        finally:
            os.environ.pop(NODE_LOST_NOTE_ENV, None)


def launch_vllm_server(args: list[str]) -> None:
    """Run vLLM's OpenAI server in this process with `args`, every endpoint behind the API key if one is set."""
    from layerwise_cli.worker.quantization import online_quant  # noqa: PLC0415, F401 - registers `layerwise_fp8`/`layerwise_int8` here

    _guard_every_endpoint()
    attach_engines_rpc()
    vllm_compat.raise_interrupts_during_engine_start()
    sys.argv = [VLLM_SERVER_MODULE, *args]
    model = args[args.index("--model") + 1] if "--model" in args[:-1] else "layerwise serve"
    # vLLM's engine process logs why it failed; the server only raises "see root cause above".
    with capture_engine_output() as output, node_lost_note() as node_lost:
        try:
            runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)
        except KeyboardInterrupt:
            # SIGTERM or Ctrl-C before the server was up (once it serves, uvicorn handles them and returns).
            sys.stderr.write(f"Error: {model}: stopped (SIGTERM or Ctrl-C) before the engine was ready\n")
            sys.exit(1)
        except Exception as exc:  # noqa: BLE001 - becomes the one-line error below
            failure = exc
        else:
            if node_lost.exists():
                sys.exit(1)  # the engine ended because a node was lost; its engine core said why, on stderr
            return
    if os.environ.get("LAYERWISE_DEBUG", "") not in {"", "0"}:
        traceback.print_exception(failure)
    # One line, as the CLI's errors (LAYERWISE_DEBUG=1 adds the traceback above it).
    sys.stderr.write(f"Error: {model}: {start_failure(failure, output.root_cause())}\n")
    sys.exit(1)


if __name__ == "__main__":
    if "--headless" in sys.argv[1:]:
        from layerwise_cli.server.headless import run_headless_node

        run_headless_node(sys.argv[1:])
    else:
        launch_vllm_server(sys.argv[1:])
