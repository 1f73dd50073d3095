"""`layerwise serve`: vLLM's OpenAI server with layerwise's worker extension and the dev endpoints on."""

from __future__ import annotations

import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import UsageError
from ._options import DtypeOpt, EnforceEagerOpt, MaxModelLenOpt, MemoryFractionOpt, QuantizationOpt, TensorParallelOpt
from ._output import handle_errors, stderr

# The module this process becomes: it starts vLLM's own server entry point.
LAUNCHER_MODULE = "layerwise_cli.cli.serve"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# With an API key, these stay open (health checks, load balancers, Prometheus).
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
DEV_ENDPOINTS = "/collective_rpc, /pause, /resume, /update_weight_version, /weight_checker"


@dataclass
class ServePlan:
    """The command `layerwise serve` runs, and what it must say first."""

    argv: list[str]
    env: dict[str, str]
    warnings: list[str] = field(default_factory=list)

    def shown(self) -> str:
        """The command line as a shell would run it (the API key travels in the environment, never here)."""
        settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items() if k != "VLLM_API_KEY")
        key = " VLLM_API_KEY=<hidden>" if "VLLM_API_KEY" in self.env else ""
        return f"{settings}{key} {shlex.join(self.argv)}"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in {"localhost", "localhost.localdomain"}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# Options layerwise serve sets itself. vLLM's parser takes the last of a repeated option, accepts `_` for
# `-` and unique prefixes (`--hos` is `--host`), so a pass-through copy would silently win: refuse them.
# `--config` is refused too: its YAML file can set any of them.
GOVERNED_OPTIONS = {
    "--model": "the MODEL argument", "--host": "--host (and --allow-remote)", "--port": "--port",
    "--uds": "--host and --port", "--api-key": "--api-key (it covers the reload endpoints too)",
    "--worker-extension-cls": "nothing: the reload endpoints need layerwise's extension",
    "--config": "layerwise serve's own options (a config file can set the ones it governs)",
    "--dtype": "--dtype", "--tensor-parallel-size": "--tensor-parallel-size",
    "--max-model-len": "--max-model-len", "--quantization": "--quantization",
}
_GOVERNED_SHORT = {"-tp": "--tensor-parallel-size", "-q": "--quantization"}


def governed_option(arg: str) -> str | None:
    """The governed option that a pass-through argument would set in vLLM's parser, or None.

    Matches every spelling vLLM accepts: `--host`, `--host=X`, underscores
    (`--api_key`), unique prefixes (`--hos`), and the short forms `-tp`/`-q`
    with or without an attached value (`-tp2`, `-q=fp8`).
    """
    if arg.startswith("--") and len(arg) > 2:
        key = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        for option in GOVERNED_OPTIONS:
            # A strict prefix of a governed option is either that option or ambiguous to argparse.
            if key == option or (len(key) > 3 and option.startswith(key)):
                return option
        return None
    if arg.startswith("-") and not arg.startswith("--"):
        for short, option in _GOVERNED_SHORT.items():
            if arg.startswith(short):
                return option
    return None


def _refuse_governed(extra: list[str]) -> None:
    for arg in extra:
        option = governed_option(arg)
        if option is not None:
            spelled = arg.split("=", 1)[0]
            shown = spelled if spelled == option else f"{spelled} (vLLM reads it as {option})"
            raise UsageError(f"{shown} is set by layerwise serve and cannot pass through to vLLM; use "
                             f"{GOVERNED_OPTIONS[option]} instead", where="layerwise serve")


def plan_serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, allow_remote: bool = False,
               api_key: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1,
               max_model_len: int | None = None, quantization: str | None = None,
               enforce_eager: bool | None = None, memory_fraction: float | None = None,
               extra: list[str] | None = None, on_gpu: bool = False) -> ServePlan:
    """Build the server command and its environment; refuse unsafe or conflicting settings.

    Args:
        model: what vLLM serves (a checkpoint directory or Hub repo id).
        host: the address to bind; anything but loopback needs `allow_remote`.
        port: the port to bind.
        allow_remote: accept a non-loopback `host` (with a warning).
        api_key: required as a bearer token on every endpoint except
            `OPEN_PATHS`, the dev endpoints included.
        on_gpu: whether an NVIDIA GPU is present (picks the defaults).
        extra: further vLLM server options, passed through as they are.

    Returns:
        The plan (argv, environment additions, warnings to print).

    Raises:
        UsageError: a non-loopback host without `allow_remote`, or a
            pass-through option that layerwise sets itself (`GOVERNED_OPTIONS`).
    """
    extra = list(extra or [])
    _refuse_governed(extra)
    warnings: list[str] = []
    if not is_loopback(host):
        if not allow_remote:
            raise UsageError(f"--host {host} would let other machines reach the reload endpoints ({DEV_ENDPOINTS}), "
                             "which carry no authentication of their own: pass --allow-remote to bind it anyway, "
                             "with --api-key")
        if api_key:
            warnings.append(f"binding {host}: other machines can reach this server; every endpoint but "
                            f"{', '.join(OPEN_PATHS)} requires the API key (layerwise serve extends vLLM's key "
                            "check, which covers only /v1, to the reload endpoints); the traffic is plain HTTP: "
                            "put TLS in front of it")
        else:
            warnings.append(f"binding {host}: the reload endpoints ({DEV_ENDPOINTS}) carry no authentication of "
                            "their own: anyone who can reach this port can replace the model's weights or run "
                            "methods on its workers. Pass --api-key KEY (or set LAYERWISE_API_KEY) to require it "
                            "on them")
    from .. import EXTENSION_CLS

    argv = [sys.executable, "-m", LAUNCHER_MODULE, "--model", model, "--host", host, "--port", str(port),
            "--worker-extension-cls", EXTENSION_CLS, "--dtype", dtype,
            "--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if quantization:
        argv += ["--quantization", quantization]
    eager = (not on_gpu) if enforce_eager is None else enforce_eager
    if eager and not {"--enforce-eager", "--no-enforce-eager"} & set(extra):
        argv.append("--enforce-eager")
    fraction = memory_fraction if memory_fraction is not None else (None if on_gpu else 0.1)
    if fraction is not None and not any(a.startswith("--gpu-memory-utilization") for a in extra):
        argv += ["--gpu-memory-utilization", str(fraction)]
    argv += extra
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if api_key:
        # In the environment, not on the command line, where `ps` shows it.
        env["VLLM_API_KEY"] = api_key
    if tensor_parallel_size > 1 and not on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        from ..engine.local import _cpu_binding

        env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_binding(tensor_parallel_size)
    return ServePlan(argv=argv, env=env, warnings=warnings)


@handle_errors
def serve_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to serve: a checkpoint directory or Hub repo id.",
                                         show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to bind. Anything but loopback needs "
                                      "--allow-remote.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to bind.")] = 8000,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="Allow a --host other machines can reach "
                                               "(the reload endpoints have no authentication of their own: "
                                               "use --api-key).")] = False,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LAYERWISE_API_KEY", show_envvar=True, show_default=False,
        help="Require this bearer token on every endpoint except /health, /ping, /version and /metrics, the "
        "reload endpoints included (vLLM's own --api-key covers only /v1).")] = None,
    dtype: DtypeOpt = "auto",
    tensor_parallel_size: TensorParallelOpt = 1,
    max_model_len: MaxModelLenOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the server command and exit.")] = False,
) -> None:
    """Serve MODEL with vLLM's OpenAI server, ready for `layerwise reload --url`.

    Starts `python -m vllm.entrypoints.openai.api_server` with layerwise's
    worker extension and vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1), bound
    to 127.0.0.1 unless told otherwise. Options it does not know pass through
    to vLLM. This process becomes the server (exec): signals, exit code and
    PID are vLLM's own.

    Example: layerwise serve ./step-100 --port 8000 --max-model-len 4096 --max-num-seqs 64
    """
    from ..engine.local import cuda_available

    plan = plan_serve(model, host=host, port=port, allow_remote=allow_remote, api_key=api_key, dtype=dtype,
                      tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                      quantization=quantization, enforce_eager=enforce_eager, memory_fraction=memory_fraction,
                      extra=list(ctx.args), on_gpu=cuda_available())
    for warning in plan.warnings:
        stderr.print(f"[yellow]Warning:[/] {escape(warning)}")
    if dry_run:
        sys.stdout.write(plan.shown() + "\n")
        return
    stderr.print(f"Serving {escape(model)} on http://{host}:{port} (reload it with: layerwise reload --weights-path "
                 f"NEW --url http://{host}:{port})")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, **plan.env}
    os.execvpe(plan.argv[0], plan.argv, env)


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

    _guard_every_endpoint()
    sys.argv = [VLLM_SERVER_MODULE, *args]
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    launch_vllm_server(sys.argv[1:])
