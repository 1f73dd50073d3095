"""The Hub fetcher against the loopback Hub: pinning, exact ranges, faults, tokens, the cache afterwards."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerwise_cli.checkpoint.fetch.partial_blob import PARTIAL_SUFFIX, RECORD_SUFFIX
from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.fetch.range_fetcher import ByteRange, RangeFetcher, tensor_range, whole_files
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.hub.pin import HubPin, pin_commit, repo_cache_folder
from layerwise_cli.checkpoint.hub.range_source import HubSource
from layerwise_cli.checkpoint.sources import open_checkpoint, resolve_local
from layerwise_cli.errors import LayerwiseError
from tests.support.hub_server import Fault, HubServer
from tests.support.synthetic import SyntheticModel, write_checkpoint

MODEL = SyntheticModel(layers=4, hidden=128, intermediate=256, vocab=256)
FAST = FetchPolicy(stall_s=5, retries=3, backoff_s=0.05, max_backoff_s=0.2)
TOKEN = "hf_loopbackSecretToken0123456789"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-fetch")
    a, b = root / "a", root / "b"
    write_checkpoint(a, MODEL, "in_order", 3, data=lambda _name, n: os.urandom(n))
    write_checkpoint(b, MODEL, "in_order", 3, data=lambda _name, n: os.urandom(n))
    return {"a": a, "b": b}


def _use(hub: HubServer, monkeypatch: pytest.MonkeyPatch, cache: Path) -> HubServer:
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE at import: point its constants here instead.
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


@pytest.fixture
def hub(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(cdn=True)
    server.add_repo("org/m", folders["a"])
    with server:
        yield _use(server, monkeypatch, tmp_path / "cache")


def shards(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}


def fetcher(pin: HubPin, ranges: list[ByteRange], cache: Path, *, policy: FetchPolicy = FAST,
            token: str | None = None, **kwargs: object) -> RangeFetcher:
    options: dict = {"part_bytes": 64 << 10, "connections": 3, **kwargs}
    return RangeFetcher(HubSource(pin, cache_dir=cache, policy=policy, token=token), ranges, **options)


def cache_of(hub: HubServer) -> Path:
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    return Path(constants.HF_HUB_CACHE)


def read_all(f: RangeFetcher, ranges: list[ByteRange]) -> dict[ByteRange, bytes]:
    return {r: f.read(r.filename, r.start, r.size) for r in ranges}


def test_a_ref_moved_mid_operation_changes_nothing(hub: HubServer, folders: dict[str, Path]) -> None:
    commit_a = hub.resolve("org/m", "main").commit
    moved: list[str] = []

    def push_once(request: object) -> None:
        if not moved and getattr(request, "path", "").endswith(".safetensors"):
            moved.append(hub.move_ref("org/m", "main", folders["b"]))

    hub.on_request = push_once
    checkpoint = open_checkpoint("org/m")  # main moves as its first shard header is read
    assert moved and checkpoint.commit == commit_a and checkpoint.revision is None
    assert checkpoint.shards == open_checkpoint(str(folders["a"])).shards
    pin = HubPin("org/m", checkpoint.commit)
    files = shards(folders["a"])
    with fetcher(pin, whole_files(files), cache_of(hub)) as f:
        for name, size in files.items():
            assert f.read(name, 0, size) == (folders["a"] / name).read_bytes()
        f.check()
    resolves = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert all(f"/resolve/{commit_a}/" in p for p in resolves[1:]), resolves[:3]  # only the pin named a branch
    assert pin_commit("org/m").commit == moved[0] != commit_a  # a new operation sees the push


def test_a_vanished_commit_is_one_line_naming_repo_and_commit(hub: HubServer) -> None:
    pin = pin_commit("org/m")
    hub.forget_commit("org/m", pin.commit)
    hub.move_ref("org/m", "main", hub.resolve("org/m", "main").folder)  # force-pushed: main names a new commit
    expected = f"org/m@{pin.commit}: this commit is no longer on the Hub (force-pushed away, or the repo was deleted)"
    with pytest.raises(LayerwiseError) as caught:
        fetcher(pin, [ByteRange("model-00001-of-00003.safetensors", 0, 8)], cache_of(hub)).start()
    assert str(caught.value) == expected
    for call in (lambda: resolve_local("org/m", pin.commit), lambda: open_checkpoint("org/m", pin.commit)):
        with pytest.raises(LayerwiseError) as caught:
            call()
        assert str(caught.value) == expected


def _tensor_ranges(folder: Path, every: int) -> list[ByteRange]:
    out = []
    for name in shards(folder):
        shard, _ = read_shard_header(folder / name, name)
        out += [tensor_range(shard, t) for t in shard.tensors[::every]]
    return out


def test_only_the_asked_ranges_are_fetched_and_a_partial_file_is_never_linked(
        hub: HubServer, folders: dict[str, Path]) -> None:
    ranges = _tensor_ranges(folders["a"], every=3)
    asked = sum(r.size for r in ranges)
    pin = pin_commit("org/m")
    hub.reset_counts()
    with fetcher(pin, ranges, cache_of(hub)) as f:
        for r, got in read_all(f, ranges).items():
            with open(folders["a"] / r.filename, "rb") as local:
                local.seek(r.start)
                assert got == local.read(r.size), r
        with pytest.raises(LayerwiseError, match=r"^org/m@[0-9a-f]{40}/model-00001-of-00003.safetensors: bytes 0-8 "
                                                 r"are not in the fetch plan$"):
            f.wait("model-00001-of-00003.safetensors", 0, 8)
    sent = hub.sent_for(".safetensors")
    assert asked <= sent <= 1.05 * asked and f.bytes_fetched == sent
    folder = repo_cache_folder("org/m", cache_of(hub))
    assert not (folder / "snapshots" / pin.commit).exists()
    assert all(p.name.endswith((PARTIAL_SUFFIX, RECORD_SUFFIX)) for p in (folder / "blobs").iterdir())


def test_fetching_stays_a_bounded_window_ahead_of_the_reader(hub: HubServer, folders: dict[str, Path]) -> None:
    files = shards(folders["a"])
    pin = pin_commit("org/m")
    with fetcher(pin, whole_files(files), cache_of(hub), window_bytes=128 << 10) as f:
        time.sleep(0.5)  # the reader has read nothing
        assert f.bytes_fetched <= 128 << 10
        name = next(iter(files))
        f.read(name, files[name] - 10, 10)  # the reader moves to the end of the first file
        time.sleep(0.5)
        assert files[name] <= f.bytes_fetched <= files[name] + (128 << 10)


def test_complete_files_are_verified_linked_and_found_offline(hub: HubServer, folders: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, hf_hub_download, snapshot_download  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    files = shards(folders["a"])
    pin = pin_commit("org/m")
    with fetcher(pin, whole_files(files), cache_of(hub)) as f:
        f.read(next(reversed(files)), 0, 8)
        for name, size in files.items():
            f.wait(name, 0, size)
    hub.reset_counts()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = Path(snapshot_download("org/m", allow_patterns=["*.safetensors"], local_files_only=True))
    assert folder.name == pin.commit
    for name in files:
        path = hf_hub_download("org/m", name, local_files_only=True)
        assert Path(path).read_bytes() == (folders["a"] / name).read_bytes()
    assert hub.requests == []


def test_a_dropped_connection_resumes_from_the_last_byte(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.faults += [Fault(name, "drop", times=2, after_bytes=5000)]
    hub.cdn_ttl_s = 0.05  # each resumed try asks /resolve/ again: an expired storage URL never bites
    with fetcher(pin_commit("org/m"), whole_files({name: size}), cache_of(hub), part_bytes=size) as f:
        assert f.read(name, 0, size) == (folders["a"] / name).read_bytes()
    assert hub.sent_for_file(name) == size  # no byte twice
    ranges = [r.range for r in hub.requests if r.origin == "cdn"]
    assert ranges[:3] == [f"bytes=0-{size - 1}", f"bytes=5000-{size - 1}", f"bytes=10000-{size - 1}"]


@pytest.mark.parametrize("status", [429, 500, 503])
def test_rate_limits_and_server_errors_are_retried(hub: HubServer, folders: dict[str, Path], status: int) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.faults += [Fault(name, "status", times=2, status=status, retry_after=0 if status == 429 else None)]
    with fetcher(pin_commit("org/m"), whole_files({name: size}), cache_of(hub), part_bytes=size) as f:
        assert f.read(name, 0, size) == (folders["a"] / name).read_bytes()
    assert [r.status for r in hub.requests if r.origin == "cdn"] == [status, status, 206]


def test_retries_run_out_as_one_line_naming_the_file(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.faults += [Fault(name, "status", times=10, status=502)]
    pin = pin_commit("org/m")
    with fetcher(pin, whole_files({name: size}), cache_of(hub)) as f, pytest.raises(LayerwiseError) as caught:
        f.wait(name, 0, size)
    assert str(caught.value).startswith(f"{pin}/{name}: Hub request failed: Server error '502 ")
    assert "\n" not in str(caught.value)


def test_a_stall_fails_within_its_bound_naming_the_file(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.faults += [Fault(name, "stall", after_bytes=1000, stall_s=10)]
    pin = pin_commit("org/m")
    start = time.monotonic()
    policy = FetchPolicy(stall_s=0.5, retries=3, backoff_s=0.05)
    with fetcher(pin, whole_files({name: size}), cache_of(hub), policy=policy) as f, \
            pytest.raises(LayerwiseError) as caught:
        f.wait(name, 0, size)
    assert str(caught.value) == f"{pin}/{name}: no bytes for 0.5 s: the fetch stalled"
    assert time.monotonic() - start < 5


def test_bytes_that_do_not_match_the_sha256_fail_naming_the_file(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.faults += [Fault(name, "corrupt")]
    pin = pin_commit("org/m")
    with fetcher(pin, whole_files({name: size}), cache_of(hub)) as f, pytest.raises(LayerwiseError) as caught:
        f.read(name, 0, size)  # every byte is in; the sha256 is checked as the last part lands
        f.check()
    assert str(caught.value).startswith(f"{pin}/{name}: the bytes fetched do not match the Hub's sha256 ")
    assert not (repo_cache_folder("org/m", cache_of(hub)) / "snapshots").exists()


def test_the_token_stays_on_the_hub_origin_and_out_of_messages(
        hub: HubServer, folders: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    caplog.set_level(logging.DEBUG)
    pin = pin_commit("org/m")
    with fetcher(pin, whole_files({name: size}), cache_of(hub), token=TOKEN) as f:
        f.read(name, 0, size)
    hub_side = [r for r in hub.requests if r.origin == "hub" and r.path.endswith(name)]
    cdn_side = [r for r in hub.requests if r.origin == "cdn"]
    assert hub_side and cdn_side and all(r.authorization for r in hub_side)
    assert not any(r.authorization for r in cdn_side)  # the 302 left the Hub's origin: no token
    hub.faults += [Fault(name, "status", times=10, status=500)]
    with fetcher(pin, whole_files({name: size}), cache_of(hub) / "other", token=TOKEN) as f, \
            pytest.raises(LayerwiseError) as caught:
        f.wait(name, 0, size)
    assert TOKEN not in str(caught.value) and TOKEN not in caplog.text


def test_bounded_disk_fetches_the_asked_ranges_and_keeps_nothing(hub: HubServer, folders: dict[str, Path]) -> None:
    ranges = _tensor_ranges(folders["a"], every=2)
    with fetcher(pin_commit("org/m"), ranges, cache_of(hub), keep=False) as f:
        private = {f.path(name).parent for name in f.blobs}
        got = read_all(f, ranges)
    assert all(len(got[r]) == r.size for r in ranges)
    assert not any(p.exists() for p in private)
    assert not (repo_cache_folder("org/m", cache_of(hub)) / "blobs").exists()


def test_bounded_disk_gives_back_what_the_reader_released(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    window, step = 64 << 10, 16 << 10
    most = 0
    with fetcher(pin_commit("org/m"), whole_files({name: size}), cache_of(hub), keep=False, window_bytes=window,
                 part_bytes=step, connections=2) as f:
        for offset in range(0, size, step):
            f.read(name, offset, min(step, size - offset))
            f.release(name, offset, min(step, size - offset))
            most = max(most, os.stat(f.path(name)).st_blocks * 512)
        with pytest.raises(LayerwiseError, match=r"bytes 0-8 were released \(bounded disk\)$"):
            f.wait(name, 0, 8)
        assert os.stat(f.path(name)).st_blocks * 512 <= 8192  # a block at an unaligned end may stay
    assert most <= window + 2 * step < size  # the disk in use stayed near the window, never the whole file


def test_parallel_connections_beat_a_per_connection_throttle(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.throttle_bps = 4 * size  # one connection: 0.25 s for the file
    pin = pin_commit("org/m")
    times = {}
    for connections in (1, 4):
        start = time.monotonic()
        with fetcher(pin, whole_files({name: size}), cache_of(hub), keep=False, connections=connections,
                     part_bytes=size // 4 + 1) as f:
            f.wait(name, 0, size)
        times[connections] = time.monotonic() - start
    assert times[4] < 0.6 * times[1], times


def test_the_reader_waits_for_bytes_still_on_the_way(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    hub.throttle_bps = 2 * size  # half a second per connection for the whole file
    local = (folders["a"] / name).read_bytes()
    with fetcher(pin_commit("org/m"), whole_files({name: size}), cache_of(hub), keep=False, connections=2) as f:
        step = 10_000
        assert f.bytes_fetched < size  # reading starts while most of the file is still on the way
        got = b"".join(f.read(name, offset, min(step, size - offset)) for offset in range(0, size, step))
    assert got == local


def test_a_pinned_commit_is_downloaded_whole_after_its_branch_moved(hub: HubServer, folders: dict[str, Path]) -> None:
    pin = pin_commit("org/m")
    hub.move_ref("org/m", "main", folders["b"])
    folder = resolve_local("org/m", pin.commit)
    assert folder.name == pin.commit
    for name in shards(folders["a"]):
        assert (folder / name).read_bytes() == (folders["a"] / name).read_bytes()
    assert open_checkpoint("org/m", pin.commit).shards == open_checkpoint(str(folders["a"])).shards
    assert not any("/resolve/main/" in r.path or "/revision/main" in r.path for r in hub.requests[1:])


_KILLED_FETCH = """
import sys
from pathlib import Path
from layerwise_cli.checkpoint.fetch.range_fetcher import RangeFetcher, whole_files
from layerwise_cli.checkpoint.hub.pin import HubPin
from layerwise_cli.checkpoint.hub.range_source import HubSource
name, size, commit, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
f = RangeFetcher(HubSource(HubPin("org/m", commit), cache_dir=cache), whole_files({name: size}), part_bytes=16 << 10,
                 connections=1).start()
f.wait(name, 0, 48 << 10)
print("READY", flush=True)
sys.stdin.read()
"""


def test_a_fetch_killed_half_way_is_resumed(hub: HubServer, folders: dict[str, Path]) -> None:
    name, size = next(iter(shards(folders["a"]).items()))
    pin = pin_commit("org/m")
    cache = cache_of(hub)
    hub.throttle_bps = size // 2  # about two seconds for the file
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": str(Path.cwd())}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_FETCH), name, str(size), pin.commit,
                             str(cache)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The server counts a response's bytes when its write fails on the closed socket: wait for the count to settle.
    first, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline and (first < 48 << 10 or first != hub.sent_for_file(name)):
        first = hub.sent_for_file(name)
        time.sleep(0.3)
    assert (48 << 10) <= first < size
    hub.throttle_bps = None
    (record,) = (repo_cache_folder("org/m", cache) / "blobs").glob(f"*{RECORD_SUFFIX}")
    recorded = sum(b - a for a, b in json.loads(record.read_text())["received"])
    assert recorded >= 32 << 10  # the parts flushed before the kill (the last one may not be)
    with fetcher(pin, whole_files({name: size}), cache) as f:
        assert f.read(name, 0, size) == (folders["a"] / name).read_bytes()
    assert hub.sent_for_file(name) - first == size - recorded  # what the killed run recorded is not fetched again
    assert (repo_cache_folder("org/m", cache) / "snapshots" / pin.commit / name).is_file()
