"""What an all-or-nothing fleet update costs, against three real `layerwise serve` servers on loopback.

Starts three servers, each in a directory of its own (two on the demo's dense *multiply*, one on its MoE
*multiply*), then runs `--rounds` updates of each kind, alternating *add* and *multiply* on every node under a
relative step path: all or nothing (`--atomic`), each server on its own (`--no-atomic`), and all or nothing with
NaN in the MoE node's last layer (so the dense servers are reloaded back). Prints each kind's median time paused
per server and wall time, and checks after every round that the servers agree (answers and weight version).

    python scripts/fleet_check.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from layerwise_cli.client.servers.reload_servers import RemoteOptions, reload_servers
from layerwise_cli.demo import demo_checkpoint, expected_answer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.engine_support import nan_in_final_norm, reshard  # noqa: E402 - after the checkout is on the path
from tests.support.server_support import RunningServer, own_core, start_servers  # noqa: E402 - after the checkout is on the path

PAIRS = [(3, 4), (2, 5)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="layerwise-fleet-"))
    nodes = [work / f"node{i}" for i in range(3)]
    for node in nodes:
        node.mkdir()
    kinds = ["", "", "moe-"]
    servers = [RunningServer(demo_checkpoint(f"{kind}multiply"), cwd=node, env=own_core(i), start_timeout=600)
               for i, (kind, node) in enumerate(zip(kinds, nodes))]

    def write(step: str, model: str, nan_on_moe: bool = False) -> None:
        for kind, node in zip(kinds, nodes):
            reshard(demo_checkpoint(f"{kind}{model}"), node / step, lambda n: "a" if ".layers.0." in n else "b",
                    transform=nan_in_final_norm if nan_on_moe and kind else None)

    figures: dict[str, list[tuple[float, float]]] = {"atomic": [], "no-atomic": [], "atomic, one fails": []}
    failures = 0
    try:
        start_servers(servers)
        serving, count = "multiply", 0
        for round_ in range(args.rounds):
            for kind in figures:
                count += 1
                model = "add" if serving == "multiply" else "multiply"
                step = f"step_{count}"
                write(step, model, nan_on_moe=kind == "atomic, one fails")
                results = reload_servers([s.url for s in servers], step, RemoteOptions(weight_version=step),
                                         atomic=kind != "no-atomic")
                landed = all(r.ok for r in results)
                if landed:
                    serving = model
                answers = {tuple(s.answers(PAIRS)) for s in servers}
                agree = answers == {tuple(expected_answer(serving, a, b) for a, b in PAIRS)}
                if not agree or landed != (kind != "atomic, one fails"):
                    failures += 1
                paused = statistics.median(r.paused_s for r in results[:2])
                wall = max(r.wall_s for r in results)
                figures[kind].append((paused, wall))
                print(f"round {round_ + 1} {kind:18s} landed={landed!s:5s} servers agree={agree!s:5s} "
                      f"paused {paused * 1000:.0f} ms (dense servers, median), wall {wall * 1000:.0f} ms")
    finally:
        for server in servers:
            server.__exit__(None, None, None)
    print()
    for kind, values in figures.items():
        if values:
            print(f"{kind:18s} paused median {statistics.median(v[0] for v in values) * 1000:.0f} ms, "
                  f"wall median {statistics.median(v[1] for v in values) * 1000:.0f} ms over {len(values)} rounds")
    print("all rounds ok" if not failures else f"{failures} round(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
