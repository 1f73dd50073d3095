"""The `layerwise serve` process: vLLM's OpenAI server, with every endpoint behind the API key when one is set.

Run as `python -m layerwise_cli.server.launch ARGS` (what `layerwise serve`
execs); it imports neither Typer nor Rich.
"""

from __future__ import annotations

import sys

from layerwise_cli.server.command_line import OPEN_PATHS
from layerwise_cli.server.engines_rpc import attach_engines_rpc

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _guard_every_endpoint() -> None:
    """Make vLLM's API-key check cover every path except `OPEN_PATHS` (vLLM's covers only /v1 and a few).

    vLLM adds its middleware only when a key is set (`--api-key` or
    VLLM_API_KEY), and imports the class when it adds it: replacing the
    class here, before the server starts, is enough.
    """
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware import authenticate

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


def launch_vllm_server(args: list[str]) -> None:
    """Run vLLM's OpenAI server in this process with `args`, every endpoint behind the API key if one is set."""
    import runpy

    from layerwise_cli.worker import online_quant  # noqa: F401 - registers `layerwise_fp8`/`layerwise_int8` here

    _guard_every_endpoint()
    attach_engines_rpc()
    sys.argv = [VLLM_SERVER_MODULE, *args]
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    launch_vllm_server(sys.argv[1:])
