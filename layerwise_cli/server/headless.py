"""The `layerwise serve --headless` process: one follower node's workers of an engine led by node 0, no API server.

Runs vLLM's own `vllm serve --headless` path in this process (vLLM's
OpenAI server module would start an API server on a follower, which fails
on its first call to the workers), with what `layerwise serve` gives node 0
(the worker extension comes in ARGS; the online quantization methods are
registered here), and exits, with a one-line reason, once node 0 is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from layerwise_cli import vllm_compat
from layerwise_cli.engine_output import capture_engine_output, start_failure
from layerwise_cli.server.nodes import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
from layerwise_cli.server.peer_watch import INTERVAL_S, PeerWatch, leader_gone, reachable


def option_value(args: list[str], option: str, default: str) -> str:
    """The value ARGS give OPTION (`--opt V` or `--opt=V`, the last one wins, as in argparse), else DEFAULT."""
    value = default
    for index, arg in enumerate(args):
        if arg == option and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def model_first(args: list[str]) -> list[str]:
    """ARGS with `--model M` made the leading positional MODEL, as `vllm serve` wants it (it warns otherwise)."""
    if "--model" not in args[:-1]:
        return list(args)
    at = args.index("--model")
    return [args[at + 1], *args[:at], *args[at + 2:]]


def _stop_this_node(reason: str) -> None:
    """Say why, then end this process as SIGTERM does (vLLM's handler stops the workers on the way out)."""
    sys.stderr.write(f"Error: {reason}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)


def run_headless_node(args: list[str]) -> None:
    """Run this node's workers until the engine stops or node 0 is gone (then exit 1, the reason on stderr).

    A start that fails (a model this node cannot read, a port in use) ends
    in one line, as node 0's does; so does an engine whose workers ended
    with node 0 before the watch noticed.

    Args:
        args: vLLM's serve options, `--headless`, `--node-rank` and the
            leader's `--master-addr`/`--master-port` among them (the
            command `server/command_line.py` builds).
    """
    from layerwise_cli.worker.quantization import online_quant  # noqa: PLC0415, F401 - registers `layerwise_fp8`/`layerwise_int8` here

    host = option_value(args, "--master-addr", DEFAULT_MASTER_ADDR)
    port = int(option_value(args, "--master-port", str(DEFAULT_MASTER_PORT)))
    where = f"{option_value(args, '--model', 'layerwise serve')}: node {option_value(args, '--node-rank', '?')}"
    watch = PeerWatch(host, port, on_gone=_stop_this_node, describe=leader_gone(host, port)).start()
    failure: Exception | None = None
    with capture_engine_output() as output:
        try:
            vllm_compat.run_vllm_serve(model_first(args))
        except SystemExit:
            if watch.reason is None:
                raise
        except Exception as exc:  # noqa: BLE001 - becomes the one-line error below
            failure = exc
        finally:
            watch.stop()
    if watch.reason is not None:
        sys.exit(1)  # the reason is on stderr already
    if failure is not None:
        if os.environ.get("LAYERWISE_DEBUG", "") not in {"", "0"}:
            traceback.print_exception(failure)
        sys.stderr.write(f"Error: {where}: {start_failure(failure, output.root_cause())}\n")
        sys.exit(1)
    if watch.reached and not reachable(host, port, INTERVAL_S):
        sys.stderr.write(f"Error: {where}: the engine's workers ended and its node 0 at {host}:{port} no longer "
                         "answers: restart every node to start the engine again\n")
        sys.exit(1)
