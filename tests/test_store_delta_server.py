"""A delta chain in SeaweedFS and on the loopback Hub reloaded into two real `layerwise serve` servers by URL,
`reload --url` and `watch`.

The run (`step_1` full, *multiply*; `step_2`, `step_3`, `step_4` deltas, each an RL-like step from the one
before, the first also taking every fourth layer from *add*) is uploaded as the trainer wrote it: to the bucket,
and to a Hub repo a folder per step, a commit per step (as `hf upload org/run run/step_N step_N` pushes it).
Each server has its own store cache and Hub cache (its host's). What each server holds is proved against the
full step by every tensor (`--verify`, and the full step's reload skipped whole on its digests, records and a
spot check of its files), and by answers against an engine started fresh on the full step; what it fetched is
at most 1.2 x the links it needed; a server that missed steps catches up in one reload; a delta whose base is
not in the bucket is one line, and the servers keep their weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from layerwise_cli.planning.inspect import inspect_order
from tests.support.deltas import rl_step, save_step
from tests.support.engine_support import load_tensors
from tests.support.hub_server import HubServer
from tests.support.seaweed import BUCKET, running_seaweed
from tests.support.server_support import RunningServer, own_core, run_cli, running_together

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8)]
EXTRA = ["--max-model-len", "64", "--max-num-seqs", "1"]
REPO = "org/run"
# Where each host keeps what it fetched: its store cache, its Hub cache (`HF_HOME` = the host's `hf/`).
STORE_BLOBS, HUB_BLOBS = "store/*/blobs/*", "hf/hub/models--*/blobs/*"
# What an engine started fresh on each full step answers (`fresh`); step_1's is the servers' as started (on
# *multiply*, step_1's tensors), before any reload.
FRESH: dict[str, list[str]] = {}


def write_run(root, demo_models) -> dict:
    """The trainer's run under ROOT/run (step_1 full, step_2..step_4 deltas), and each step in full under
    ROOT/full: {step: its full folder, "run": the run folder}."""
    a_dir = demo_models["multiply"]
    plan = inspect_order(str(a_dir)).plan
    changed = {layer.name for layer in plan.layers[2::4]}
    parent = {item.entry.name: item.parent for item in plan.layer_order}
    add = load_tensors(demo_models["add"])
    full = {"step_1": load_tensors(a_dir)}
    full["step_2"] = {name: add[name] if parent.get(name) in changed else rl_step(t, 0.03, i)
                      for i, (name, t) in enumerate(sorted(full["step_1"].items()))}
    full["step_3"] = {name: rl_step(t, 0.03, 50 + i) for i, (name, t) in enumerate(sorted(full["step_2"].items()))}
    full["step_4"] = {name: rl_step(t, 0.03, 90 + i) for i, (name, t) in enumerate(sorted(full["step_3"].items()))}
    out = {}
    for i, (name, tensors) in enumerate(full.items()):
        base = root / "run" / f"step_{i}" if i else None
        saved = save_step(tensors, root / "run" / name, a_dir, base=base)
        assert (saved.delta is not None) == bool(i), saved.fallback
        save_step(tensors, root / "full" / name, a_dir)
        out[name] = root / "full" / name
    out["run"] = root / "run"
    return out


@pytest.fixture(scope="module")
def run(demo_models, tmp_path_factory) -> dict:
    return write_run(tmp_path_factory.mktemp("store-delta-server"), demo_models)


@pytest.fixture(scope="module")
def s3(run):
    with running_seaweed() as server:
        for folder in sorted(run["run"].iterdir()):
            server.put_folder(f"run/{folder.name}", folder)
        yield server


@pytest.fixture(scope="module")
def hub(run, tmp_path_factory):
    """The loopback Hub serving `org/run`, steps 1 and 2 pushed (`push_steps` pushes the next ones)."""
    server = HubServer()
    server.add_repo(REPO, pushed(run, tmp_path_factory.mktemp("hub-pushes"), 2))
    with server:
        yield server


def pushed(run, root: Path, n: int) -> Path:
    """The repo's files after the trainer pushed steps 1 to N, a folder per step (`hf upload` adds, never deletes)."""
    folder = root / f"push_{n}"
    for i in range(1, n + 1):
        shutil.copytree(run["run"] / f"step_{i}", folder / f"step_{i}")
    return folder


def push_steps(hub: HubServer, run, n: int) -> None:
    """The trainer pushes steps up to N: a new commit on `main`."""
    hub.move_ref(REPO, "main", pushed(run, Path(hub.repos[REPO]["main"].folder).parent, n))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> list:
    """Each server's host: its own store cache and Hub cache, where every object it fetches is kept whole."""
    return [tmp_path_factory.mktemp("host") for _ in range(2)]


@pytest.fixture(scope="module")
def servers(demo_models, s3, hub, hosts):
    # Started at once, each on a core of its own (their start-ups overlap).
    with running_together([RunningServer(demo_models["multiply"], extra=EXTRA, start_timeout=600,
                                         env={**s3.env(LAYERWISE_CACHE=str(host), **own_core(i)),
                                              **hub_env(hub), "HF_HOME": str(host / "hf")})
                           for i, host in enumerate(hosts)]) as (x, y):
        FRESH["step_1"] = x.answers(PAIRS)
        assert y.answers(PAIRS) == FRESH["step_1"]
        yield x, y


def hub_env(hub: HubServer) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def fresh(run, step: str) -> list[str]:
    """What an engine started fresh on STEP's full folder answers (started once per module, on the first ask)."""
    if step not in FRESH:
        with RunningServer(run[step], extra=EXTRA, start_timeout=600) as server:
            FRESH[step] = server.answers(PAIRS)
    return FRESH[step]


def fetched(hosts, *steps: Callable[[], object], kept_in: str = STORE_BLOBS) -> list[int]:
    """The bytes of objects each host fetched while STEPS ran: what its store cache (or, KEPT_IN=`HUB_BLOBS`,
    its Hub cache) gained. A reload keeps every object it fetches, whole (under its ETag in the store cache,
    its sha256 in the Hub cache); header ranges are read and not kept."""
    def kept(host) -> int:
        return sum(p.stat().st_size for p in host.glob(kept_in) if p.is_file())

    before = [kept(host) for host in hosts]
    for step in steps:
        step()
    return [kept(host) - b for host, b in zip(hosts, before)]


def url(step: str) -> str:
    return f"s3://{BUCKET}/run/{step}"


def hf(step: str) -> str:
    return f"hf://{REPO}/{step}"


def reload(s3, targets, source, *args: str) -> list[dict]:
    return reload_with(s3.env(), targets, source, *args)


def reload_with(env: dict[str, str], targets, source, *args: str) -> list[dict]:
    done = run_cli("reload", "--weights-path", str(source), *(a for t in targets for a in ("--url", t.url)),
                   "--json", *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [entry["report"] | {"verify": entry.get("verify")} for entry in json.loads(done.stdout)["servers"]]


def link_bytes(run, *steps: str) -> int:
    """The bytes of the steps' weight files: a delta step's delta file, a full step's shards."""
    return sum(p.stat().st_size for step in steps for p in (run["run"] / step).glob("*.safetensors"))


def assert_holds(s3, targets, full_step) -> None:
    """Every target holds FULL_STEP: its reload is skipped whole (digests, records, a spot check of its files),
    and `--verify` compares every layer of the engine with it."""
    for report in reload(s3, targets, full_step, "--verify"):
        assert report["bytes"] == 0 and report["skipped_layers"] == len(report["layers"]), report
        assert report["verify"]["ok"] and report["verify"]["checked"] > 0, report["verify"]


def test_a_chain_by_url_moves_two_servers_a_b_a_b_fetching_only_the_links(servers, hosts, s3, run) -> None:
    x, y = servers
    # Each host fetches step_1's shards once, and keeps them in its store cache.
    first = fetched(hosts, lambda: reload(s3, servers, url("step_1"), "--all"))
    assert all(n == link_bytes(run, "step_1") for n in first), first
    for round_trip in range(2):  # A, B, A, B
        to_b: list[dict] = []
        sent = fetched(hosts, lambda out=to_b: out.extend(reload(s3, servers, url("step_2"), "--verify")))
        assert all(r["verify"]["ok"] and r["verify"]["checked"] > 0 for r in to_b)
        # The first time, step_2's link (and its config.json); then it is kept: nothing.
        want = link_bytes(run, "step_2") if round_trip == 0 else 0
        assert all(want <= n <= 1.2 * want for n in sent), sent
        assert_holds(s3, servers, run["step_2"])
        assert fetched(hosts, lambda: reload(s3, servers, url("step_1"))) == [0, 0]  # from each host's cache
        assert_holds(s3, servers, run["step_1"])
    reload(s3, servers, url("step_2"))
    # x follows every step; y misses step_3 and catches up in one reload, fetching step_3's and step_4's links.
    on_x = fetched(hosts, lambda: reload(s3, [x], url("step_3")))[0]
    assert link_bytes(run, "step_3") <= on_x <= 1.2 * link_bytes(run, "step_3")
    on_x, on_y = fetched(hosts, lambda: reload(s3, [x], url("step_4")), lambda: reload(s3, [y], url("step_4")))
    assert link_bytes(run, "step_4") <= on_x <= 1.2 * link_bytes(run, "step_4")
    assert link_bytes(run, "step_3", "step_4") <= on_y <= 1.2 * link_bytes(run, "step_3", "step_4")
    assert_holds(s3, servers, run["step_4"])
    want = fresh(run, "step_4")
    assert x.answers(PAIRS) == want and y.answers(PAIRS) == want


def test_watch_on_the_bucket_follows_the_chain(servers, s3, run, demo_models) -> None:
    x, y = servers
    reload(s3, [x], url("step_1"))  # the chain's full step: three links behind the newest
    reload(s3, [y], demo_models["add"], "--all")  # no step of the chain: given its full step, and told so
    done = run_cli("watch", f"s3://{BUCKET}/run/", *(a for t in servers for a in ("--url", t.url)), "--once",
                   "--interval", "0.1", env=s3.env())
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = [line for line in done.stderr.splitlines() if "step_4" in line and "held no step" in line]
    assert len(loaded) == 1 and y.url.split("//")[1] in loaded[0], done.stderr[-3000:]
    assert_holds(s3, servers, run["step_4"])


def test_a_delta_whose_base_is_not_in_the_bucket_is_one_line_and_changes_nothing(servers, s3, run) -> None:
    reload(s3, servers, url("step_1"))
    reload(s3, servers, url("step_2"))
    s3.put_folder("orphan/step_3", run["run"] / "step_3")
    done = run_cli("reload", "--weights-path", f"s3://{BUCKET}/orphan/step_3",
                   *(a for t in servers for a in ("--url", t.url)), env=s3.env())
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert f"its base s3://{BUCKET}/orphan/step_2 is not there" in errors[0]
    assert_holds(s3, servers, run["step_2"])


def test_a_hub_run_moves_two_servers_a_b_a_b_fetching_only_the_links(servers, hosts, hub, s3, run) -> None:
    x, y = servers
    env = hub_env(hub)

    def on_hub(targets, step: str, *args: str, out: list | None = None) -> Callable[[], None]:
        return lambda: (out if out is not None else []).extend(reload_with(env, targets, hf(step), *args))

    # Each host fetches step_1's folder once (its shards, config and tokenizer), into its Hub cache.
    first = fetched(hosts, on_hub(servers, "step_1", "--all"), kept_in=HUB_BLOBS)
    assert all(link_bytes(run, "step_1") <= n <= folder_bytes(run, "step_1") for n in first), first
    for round_trip in range(2):  # A, B, A, B
        to_b: list[dict] = []
        sent = fetched(hosts, on_hub(servers, "step_2", "--verify", out=to_b), kept_in=HUB_BLOBS)
        assert all(r["verify"]["ok"] and r["verify"]["checked"] > 0 for r in to_b), to_b
        # The first time, step_2's delta file (its config and tokenizer are step_1's blobs); then nothing.
        want = link_bytes(run, "step_2") if round_trip == 0 else 0
        assert all(want <= n <= 1.2 * want for n in sent), sent
        assert_holds(s3, servers, run["step_2"])
        assert fetched(hosts, on_hub(servers, "step_1"), kept_in=HUB_BLOBS) == [0, 0]
        assert_holds(s3, servers, run["step_1"])
        assert x.answers(PAIRS) == FRESH["step_1"] and y.answers(PAIRS) == FRESH["step_1"]
    reload_with(env, servers, hf("step_2"))
    # The trainer pushes step_3, then step_4 (a commit each). x follows every step; y misses both pushes and
    # catches up in one reload, fetching step_3's and step_4's delta files (at the same time).
    push_steps(hub, run, 3)
    on_x = fetched(hosts, on_hub([x], "step_3"), kept_in=HUB_BLOBS)[0]
    assert link_bytes(run, "step_3") <= on_x <= 1.2 * link_bytes(run, "step_3")
    push_steps(hub, run, 4)
    on_x, on_y = fetched(hosts, on_hub([x], "step_4"), on_hub([y], "step_4"), kept_in=HUB_BLOBS)
    assert link_bytes(run, "step_4") <= on_x <= 1.2 * link_bytes(run, "step_4")
    assert link_bytes(run, "step_3", "step_4") <= on_y <= 1.2 * link_bytes(run, "step_3", "step_4")
    assert_holds(s3, servers, run["step_4"])
    want = fresh(run, "step_4")
    assert x.answers(PAIRS) == want and y.answers(PAIRS) == want


def folder_bytes(run, step: str) -> int:
    """The bytes of every file of STEP's folder in the run."""
    return sum(p.stat().st_size for p in (run["run"] / step).iterdir() if p.is_file())
