"""`layerwise serve`: vLLM's OpenAI server with layerwise's worker extension and the dev endpoints on."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.markup import escape

from layerwise_cli.cli._options import ENGINE_DEFAULTS, EngineFlags, takes_engine_flags
from layerwise_cli.cli._output import handle_errors, stderr
from layerwise_cli.client.pinning import pin_engine_args
from layerwise_cli.engine_defaults import cuda_available
from layerwise_cli.server.command_line import server_command_line
from layerwise_cli.server.nodes import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, NodePlacement

SERVER_PANEL = "Server"
NODES_PANEL = "Nodes (one engine across nodes)"


@handle_errors
@takes_engine_flags
def serve_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The model to serve: a checkpoint directory or Hub repo id.",
                                         show_default=False)],
    host: Annotated[str, typer.Option("--host", metavar="ADDRESS", rich_help_panel=SERVER_PANEL,
                                      help="Address to bind; anything but loopback needs --allow-remote.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, metavar="PORT", help="Port to bind.",
                                      rich_help_panel=SERVER_PANEL)] = 8000,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", rich_help_panel=SERVER_PANEL,
                                               help="Allow a --host other machines can reach (then use "
                                               "--api-key: the reload endpoints have no other check).")] = False,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LAYERWISE_API_KEY", show_envvar=True, show_default=False, metavar="KEY",
        rich_help_panel=SERVER_PANEL,
        help="Require this bearer token on every endpoint but /health, /ping, /version and /metrics, the reload "
        "endpoints included.")] = None,
    engine: EngineFlags = ENGINE_DEFAULTS,
    nnodes: Annotated[int, typer.Option("--nnodes", "-n", min=1, metavar="N", rich_help_panel=NODES_PANEL,
                                        help="Nodes that run the engine's workers together (no Ray).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", "-r", min=0, metavar="R", rich_help_panel=NODES_PANEL,
                                           help="This node's rank: 0 runs the API server, 1 and up need "
                                           "--headless.")] = 0,
    master_addr: Annotated[str, typer.Option("--master-addr", metavar="ADDRESS", rich_help_panel=NODES_PANEL,
                                             help="Node 0's address, reachable from every node.")]
    = DEFAULT_MASTER_ADDR,
    master_port: Annotated[int, typer.Option("--master-port", min=1, max=65535, metavar="PORT",
                                             rich_help_panel=NODES_PANEL, help="A free port on node 0 for the "
                                             "nodes' rendezvous, the same on every node.")] = DEFAULT_MASTER_PORT,
    headless: Annotated[bool, typer.Option("--headless", rich_help_panel=NODES_PANEL,
                                           help="Run this node's workers only, no API server (every node but "
                                           "node 0); exits when node 0 is gone.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the server command and exit.",
                                          rich_help_panel=SERVER_PANEL)] = False,
) -> None:
    """Serve MODEL with vLLM's OpenAI server, ready for `layerwise reload --url`.

    Starts `python -m vllm.entrypoints.openai.api_server` with layerwise's
    worker extension and vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1), bound
    to 127.0.0.1 unless told otherwise. Options it does not know pass through
    to vLLM. This process becomes the server (exec): signals, exit code and
    PID are vLLM's own.

    One engine across nodes: run the same command on every node with
    `--nnodes N --node-rank R --master-addr NODE0 --master-port P`, adding
    `--headless` on every node but node 0; reload through node 0's URL.

    Example: layerwise serve ./step-100 --port 8000 --max-model-len 4096 --max-num-seqs 64

    Example (node 1 of 2): layerwise serve ./step-100 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --headless

    The server, its endpoints and security: docs/commands/serve.md; nodes: docs/scaling-out.md.
    """
    node = NodePlacement(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                         headless=headless)

    def command_line(extra: list[str]):
        return server_command_line(model, host=host, port=port, allow_remote=allow_remote, api_key=api_key,
                                   **engine.as_kwargs(), extra=extra, on_gpu=cuda_available(), node=node)

    # A command line layerwise refuses is refused before the Hub is asked anything; then a repo id's revision
    # is resolved to the commit vLLM is handed.
    command_line(list(ctx.args))
    command = command_line(pin_engine_args(model, list(ctx.args)))
    for warning in command.warnings:
        stderr.print(f"[yellow]Warning:[/] {escape(warning)}")
    if dry_run:
        sys.stdout.write(command.shown() + "\n")
        return
    cores = f"; {escape(command.cores)}" if command.cores else ""
    if headless:
        stderr.print(f"Node {node_rank} of {nnodes}: running {escape(model)}'s workers for the engine led by "
                     f"{escape(node.leader)} (headless: reload through node 0's URL){cores}")
    else:
        stderr.print(f"Serving {escape(model)} on http://{host}:{port}{cores} (reload it with: layerwise reload "
                     f"--weights-path NEW --url http://{host}:{port})")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, **command.env}
    if command.cpus:
        os.sched_setaffinity(0, command.cpus)  # the server, its engine core and workers: off other engines' cores
    os.execvpe(command.argv[0], command.argv, env)
