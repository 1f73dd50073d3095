"""SIGKILL `layerwise reload --url` at random moments, again and again, and check the server each time.

For each of `--reloads` rounds the client reloads the other demo model (add <-> multiply) with a new weight
version tag and is SIGKILLed after a random delay, drawn over the time a whole reload takes. Then the server
must serve again within the pause lease (`--pause-lease`, plus a margin for the last renewal), answer as one of
the two models whole, and its weight-version tag must name the model it answers as. Prints one line per round
and a summary; exits 1 if any round failed.

    python scripts/kill_reload_check.py --reloads 20                  # starts `layerwise serve` on multiply
    python scripts/kill_reload_check.py --reloads 20 --kind plain     # vLLM's own server (layerwise's plugin)
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from layerwise_cli.demo import demo_checkpoint, expected_answer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.server_support import LAYERWISE, RunningServer, run_cli  # noqa: E402 - after the checkout is on the path

PAIRS = [(3, 4), (2, 5), (9, 9)]


def answers_as(server, models: tuple[str, ...]) -> str | None:
    got = server.answers(PAIRS)
    return next((name for name in models if got == [expected_answer(name, a, b) for a, b in PAIRS]), None)


def weight_version(server) -> str:
    response = httpx.get(f"{server.url}/weight_info", headers=server.headers(), timeout=10)
    response.raise_for_status()
    return response.json()["weight_version"]


def paused_for(server, limit_s: float) -> float | None:
    """Seconds until the server is unpaused, or None if still paused after LIMIT_S."""
    start = time.monotonic()
    while server.is_paused():
        if time.monotonic() - start > limit_s:
            return None
        time.sleep(0.1)
    return time.monotonic() - start


def one_reload_seconds(server, model: Path, tag: str, lease_s: float) -> float:
    start = time.monotonic()
    done = run_cli("reload", "--weights-path", str(model), "--url", server.url, "--weight-version", tag,
                   "--pause-lease", str(lease_s))
    if done.returncode != 0:
        raise SystemExit(f"the unkilled reload failed: {done.stderr[-2000:]}")
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reloads", type=int, default=20)
    parser.add_argument("--pause-lease", type=float, default=5.0)
    parser.add_argument("--kind", choices=("layerwise", "plain"), default="layerwise")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    models = {name: demo_checkpoint(name) for name in ("multiply", "add")}
    failures, pauses, while_paused = 0, [], 0
    with RunningServer(models["multiply"], kind=args.kind) as server:
        serving, version = "multiply", weight_version(server)
        # How long a whole reload takes from a client's start: the kills are drawn over it.
        span = one_reload_seconds(server, models["add"], "warm-up", args.pause_lease)
        serving, version = "add", "warm-up"
        print(f"server {server.url} ({args.kind}); a whole reload takes {span:.1f} s from the client's start; "
              f"lease {args.pause_lease:g} s")
        for round_ in range(1, args.reloads + 1):
            other = "add" if serving == "multiply" else "multiply"
            tag = f"{other}-{round_}"
            # Over the whole reload, from the client's start: most of it is the process starting up, so half the
            # kills are drawn over its last 40 %, where it pauses, reloads and resumes.
            delay = rng.uniform(0.0, span) if round_ % 2 else rng.uniform(0.6 * span, span)
            proc = subprocess.Popen([LAYERWISE, "reload", "--weights-path", str(models[other]), "--url", server.url,
                                     "--weight-version", tag, "--pause-lease", str(args.pause_lease)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            code = proc.wait()
            waited = paused_for(server, args.pause_lease + 5)
            served = answers_as(server, tuple(models)) if waited is not None else None
            now = weight_version(server) if waited is not None else None
            if served is not None and served != serving:
                serving, version = served, tag
            ok = waited is not None and served is not None and now == version
            failures += not ok
            if waited is not None:
                pauses.append(waited)
                while_paused += waited > 0.5  # the kill left a pause the lease had to end
            print(f"round {round_:2d}: killed after {delay:.2f} s ({'exited first' if code == 0 else 'killed'}); "
                  f"paused {waited if waited is None else round(waited, 2)} s more; serves {served}; tag {now!r} "
                  f"(expected {version!r}): {'ok' if ok else 'FAILED'}")
    if pauses:
        print(f"{args.reloads - failures} of {args.reloads} rounds ok; {while_paused} kill(s) left a pause, each "
              f"ended by the lease; paused after the kill: median {statistics.median(pauses):.2f} s, max "
              f"{max(pauses):.2f} s (lease {args.pause_lease:g} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
