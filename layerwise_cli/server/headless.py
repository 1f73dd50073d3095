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

from layerwise_cli import vllm_compat
from layerwise_cli.server.leader_watch import LeaderWatch
from layerwise_cli.server.nodes import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT


def option_value(args: list[str], option: str, default: str) -> str:
    """The value ARGS give OPTION (`--opt V` or `--opt=V`, the last one wins, as in argparse), else DEFAULT."""
    value = default
    for index, arg in enumerate(args):
        if arg == option and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def _stop_this_node(reason: str) -> None:
    """Say why, then end this process as SIGTERM does (vLLM's handler stops the workers on the way out)."""
    sys.stderr.write(f"Error: {reason}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)


def run_headless_node(args: list[str]) -> None:
    """Run this node's workers until the engine stops or node 0 is gone (then exit 1, the reason on stderr).

    Args:
        args: vLLM's serve options, `--headless`, `--node-rank` and the
            leader's `--master-addr`/`--master-port` among them (the
            command `server/command_line.py` builds).
    """
    from layerwise_cli.worker.quantization import online_quant  # noqa: F401 - registers `layerwise_fp8`/`layerwise_int8` here

    host = option_value(args, "--master-addr", DEFAULT_MASTER_ADDR)
    port = int(option_value(args, "--master-port", str(DEFAULT_MASTER_PORT)))
    watch = LeaderWatch(host, port, on_gone=_stop_this_node).start()
    try:
        vllm_compat.run_vllm_serve(args)
    except SystemExit:
        if watch.reason is None:
            raise
    finally:
        watch.stop()
    if watch.reason is not None:
        sys.exit(1)
