"""Where one node of a multi-node vLLM engine stands: its rank, the leader's address, the workers it runs.

vLLM's multiprocessing executor spans nodes without Ray: every node runs
`--nnodes N --node-rank R --master-addr A --master-port P`; node 0 runs the
API server and the engine core, every other node runs headless (workers
only). Plain data, no vLLM import: `server/command_line.py` builds the
command from it and `server/launch.py` reads the leader's address back.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerwise_cli.errors import UsageError

# vLLM's defaults (`ParallelConfig.master_addr`, `.master_port`).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501


@dataclass(frozen=True)
class NodePlacement:
    """One node of an engine spread over `nnodes` nodes (the defaults: an engine on one node).

    Attributes:
        nnodes: how many nodes run the engine's workers.
        node_rank: this node's rank, 0 (the leader: API server and engine core) to `nnodes - 1`.
        master_addr: the leader's address every node reaches (torch.distributed's TCP store).
        master_port: the port of that store on the leader.
        headless: this node runs workers only, no API server (every node but the leader).
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    headless: bool = False

    @property
    def spread(self) -> bool:
        """Whether the engine spans more than one node."""
        return self.nnodes > 1

    @property
    def leader(self) -> str:
        """The leader's `address:port`, as the nodes reach it."""
        return f"{self.master_addr}:{self.master_port}"

    def local_workers(self, workers: int) -> int:
        """The workers this node runs, of an engine's WORKERS (tensor x pipeline parallel) in all.

        Raises:
            UsageError: WORKERS does not split evenly over the nodes.
        """
        if workers % self.nnodes:
            raise UsageError(f"--nnodes {self.nnodes} must divide the engine's workers (tensor x pipeline "
                             f"parallel = {workers}): every node runs the same number of them",
                             where="layerwise serve")
        return workers // self.nnodes

    def argv(self) -> list[str]:
        """vLLM's options for this placement (none for an engine on one node)."""
        if not self.spread:
            return []
        argv = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--master-addr", self.master_addr, "--master-port", str(self.master_port)]
        return argv + (["--headless"] if self.headless else [])


def node_refusal(node: NodePlacement, *, data_parallel_size: int) -> str | None:
    """Why NODE cannot be started as asked (one clause, naming the flag to change), or None.

    Only the leader (rank 0) runs the API server: every other node must be
    headless, and the leader must not be (vLLM's OpenAI server started on a
    follower fails on its first call to the workers). Data parallelism over
    nodes is another vLLM mode (one engine per node) that layerwise serve
    does not start.
    """
    if node.node_rank >= node.nnodes:
        return f"--node-rank {node.node_rank} is not below --nnodes {node.nnodes}: ranks run 0 to {node.nnodes - 1}"
    if node.node_rank > 0 and not node.headless:
        return (f"--node-rank {node.node_rank} needs --headless: only node 0 runs the API server; the other nodes "
                "run workers only")
    if node.headless and node.node_rank == 0:
        return "--headless is for nodes 1 and up: node 0 runs the API server (reload through its URL)"
    if node.spread and data_parallel_size > 1:
        return ("--nnodes with --data-parallel-size > 1 is not supported by layerwise serve: it spreads one "
                "engine's tensor- and pipeline-parallel workers over the nodes")
    if node.headless and not node.spread:
        return "--headless needs --nnodes 2 or more: a headless node joins an engine led by another node"
    return None
