"""Delta steps by URL for real: a run's chain (full step, two deltas) in SeaweedFS, opened as the step it rebuilds.

A trainer's folders uploaded as they are (`step_1` full, `step_2` and `step_3` deltas, each naming its base by
the trainer's local path): the step resolves through the folders beside it, every tensor rebuilt equals the
full step, the chain is one pin, and what is fetched is what this host's store cache does not hold (a link
already kept is never fetched again). A base that is missing or deleted, and an object rewritten mid-chain,
are one line each.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.delta import remote
from layerwise_cli.checkpoint.delta.format import DELTA_FILE
from layerwise_cli.checkpoint.delta.read import first_header_read
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.fetch.range_fetcher import MiB, range_requests, spread_parts, whole_files
from layerwise_cli.checkpoint.format.digests import layer_digest
from layerwise_cli.cli.app import app
from layerwise_cli.client.pinning import store_revision
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.reload.delta_base import OFF_CHAIN_NOTE, off_chain_note
from layerwise_cli.worker.state.layer_records import LayerRecord, LayerRecords
from layerwise_cli.writer.save import save_checkpoint
from tests.support.deltas import rl_step
from tests.support.seaweed import BUCKET, SeaweedS3, running_seaweed


def _tensors(seed: int) -> dict:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(64, 128, generator=gen) * 0.02).bfloat16()
            for i in range(3)} | {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}


def _chain(root: Path) -> dict[str, dict]:
    """step_1 in full, step_2 and step_3 as deltas (each 3% of values one unit off): the tensors of each."""
    steps = {"step_1": _tensors(0)}
    steps["step_2"] = {n: rl_step(t, 0.03, 1 + i) for i, (n, t) in enumerate(sorted(steps["step_1"].items()))}
    steps["step_3"] = {n: rl_step(t, 0.03, 9 + i) for i, (n, t) in enumerate(sorted(steps["step_2"].items()))}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    base = None
    for name, tensors in steps.items():
        saved = save_checkpoint(tensors.items(), root / name, config=config, marker=None, base=base)
        assert (saved.delta is not None) == (base is not None), saved.fallback
        base = root / name
    return steps


@pytest.fixture(scope="module")
def s3() -> SeaweedS3:
    with running_seaweed() as server:
        yield server


@pytest.fixture(scope="module")
def run(s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("store-delta") / "run"
    steps = _chain(root)
    return root, steps


@pytest.fixture
def env(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in s3.env(LAYERWISE_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(key, value)


def _upload(s3: SeaweedS3, root: Path, prefix: str) -> str:
    for folder in sorted(root.iterdir()):
        s3.put_folder(f"{prefix}/{folder.name}", folder)
    return f"s3://{BUCKET}/{prefix}"


def test_a_delta_step_by_url_rebuilds_its_full_step_fetching_only_what_the_host_lacks(s3, run, env) -> None:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    from layerwise_cli.worker.stream.shard_reader import ShardReader  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    root, steps = run
    url = _upload(s3, root, "chain")
    # Nothing kept yet: the full step's shard (its JSON files came with the headers) and step_2's files.
    second = open_step(f"{url}/step_2")
    assert second.delta.fetched_bytes == _size(root, "step_1", "step_2") - _size(root, "step_1", suffix=".json")
    third = open_step(f"{url}/step_3/")
    assert third.kind == "store" and third.source == f"{url}/step_3" and third.revision.startswith("etags:")
    assert len(third.delta.links) == 2 and third.delta.base_location == str(root / "step_2")
    # step_1 and step_2 are kept: only step_3's files cross the network; at the same pin, nothing.
    assert third.delta.fetched_bytes == _size(root, "step_3")
    assert open_step(f"{url}/step_3", third.revision).delta.fetched_bytes == 0
    reader = ShardReader(third.local_dir, delta=third.delta)
    for entry in third.tensors:
        assert torch.equal(reader.read(PlannedTensor(entry, "x")), steps["step_3"][entry.name]), entry.name
    # A full step by URL is what it was: read by range, no delta.
    full = open_step(f"{url}/step_1")
    assert full.delta is None and full.local_dir is None


def test_a_host_that_missed_two_steps_fetches_both_links_together_and_the_step_equals_its_full_step(
        s3, run, env, monkeypatch) -> None:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    from layerwise_cli.worker.stream.shard_reader import ShardReader  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    root, steps = run
    url = _upload(s3, root, "missed")
    # Each missing link's fetch waits until the other's has started: fetched one after the other, they never meet.
    both = threading.Barrier(2, timeout=30)
    read_link, met = remote._read_link, []

    def meeting(source):
        if threading.current_thread().name.startswith("layerwise-links"):
            both.wait()
            met.append(source.url)
        return read_link(source)

    monkeypatch.setattr(remote, "_read_link", meeting)
    # A new host opens step_3 first: step_3's and step_2's files are fetched at once while the walk reads each
    # link's base from its header by range; then the full step's shard.
    third = open_step(f"{url}/step_3")
    assert sorted(met) == [f"{url}/step_2", f"{url}/step_3"]
    assert third.delta.fetched_bytes == _size(root, "step_1", "step_2", "step_3") - _size(root, "step_1",
                                                                                         suffix=".json")
    reader = ShardReader(third.local_dir, delta=third.delta)
    for entry in third.tensors:
        assert torch.equal(reader.read(PlannedTensor(entry, "x")), steps["step_3"][entry.name]), entry.name
    # Kept: nothing is fetched again (a link kept is read at once, in the walk: no fetch thread meets the barrier).
    both.abort()
    assert open_step(f"{url}/step_3", third.revision).delta.fetched_bytes == 0


def _counted(monkeypatch) -> list[tuple[str, str, tuple[int, int] | None]]:
    """The requests obstore sends from now on, as (HEAD or GET, `<step folder>/<file>`, the range read)."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    sent: list[tuple[str, str, tuple[int, int] | None]] = []
    head, get = obstore.head, obstore.get

    def named(store, path: str) -> str:
        return f"{store.prefix.rstrip('/').rsplit('/', 1)[-1]}/{path}"

    def counted_head(store, path, *args, **kwargs):
        sent.append(("HEAD", named(store, path), None))
        return head(store, path, *args, **kwargs)

    def counted_get(store, path, *args, options=None, **kwargs):
        sent.append(("GET", named(store, path), (options or {}).get("range")))
        return get(store, path, *args, options=options, **kwargs)

    monkeypatch.setattr(obstore, "head", counted_head)
    monkeypatch.setattr(obstore, "get", counted_get)
    return sent


def test_a_chain_is_walked_once_each_object_asked_about_once(s3, run, env, monkeypatch) -> None:
    from collections import Counter  # noqa: PLC0415 - only here

    root, _ = run
    url = _upload(s3, root, "walked")
    open_step(f"{url}/step_1")  # nothing kept: a full step by URL is read by range
    sent = _counted(monkeypatch)
    open_step(f"{url}/step_3")
    # A host missing both links: each link's delta file and config asked about once (HEAD), its header read by
    # range once (in one request, or two when the first does not hold it all) and the file fetched once (these
    # files fit in one part each); step_1 is the full step (no delta there), its headers read once and its
    # shard fetched.
    deltas = [(op, name) for op, name, _ in sent if name.endswith(DELTA_FILE)]
    assert Counter(deltas) == {("HEAD", f"step_{i}/{DELTA_FILE}"): 1 for i in (1, 2, 3)} | {
        ("GET", f"step_{i}/{DELTA_FILE}"): 1 + _header_requests(root / f"step_{i}" / DELTA_FILE) for i in (2, 3)}, sent
    assert all(n == 1 for (op, _), n in Counter((op, name) for op, name, _ in sent if op == "HEAD").items()), sent
    sent.clear()
    pin = open_step(f"{url}/step_3").revision
    # A host holding every link: a HEAD of each link's delta file and config.json, of step_1's missing delta
    # file, and step_1's headers (its config, index, shard header): nothing of a link is read again.
    heads = sorted(name for op, name, _ in sent if op == "HEAD")
    assert heads == sorted([f"step_{i}/{name}" for i in (2, 3) for name in (DELTA_FILE, "config.json")]
                           + [f"step_1/{DELTA_FILE}"]), sent
    assert [name for op, name, _ in sent if op == "GET" and not name.startswith("step_1/")] == [], sent
    sent.clear()
    assert open_step(f"{url}/step_3", pin).revision == pin and len(sent) == 9, sent


def _header_requests(file: Path) -> int:
    """The range requests that read FILE's header: one when the first holds it all (`first_header_read`)."""
    length = struct.unpack("<Q", file.read_bytes()[:8])[0]
    return 1 if 8 + length <= first_header_read(file.stat().st_size) else 2


def test_a_whole_file_fetch_spreads_over_the_connections() -> None:
    # A 13 MB delta file over 4 connections: 4 parts, not one (at one connection's paced rate).
    parts = range_requests(whole_files({"delta.safetensors": 13_000_000}), spread_parts(13_000_000, 4))
    assert len(parts) == 4 and sum(p.size for p in parts) == 13_000_000
    assert spread_parts(10, 4) == MiB and spread_parts(10 << 30, 4) == 16 * MiB


def test_a_missing_or_deleted_base_is_one_line(s3, run, env) -> None:
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    root, _ = run
    url = _upload(s3, root, "gone")
    pinned = open_step(f"{url}/step_3").revision
    store = s3.objects("gone/step_1")
    obstore.delete(store, [str(m["path"]) for page in obstore.list(store) for m in page])
    for revision in (None, pinned):
        with pytest.raises(LayerwiseError) as err:
            open_step(f"{url}/step_3", revision)
        assert str(err.value).startswith(f"{url}/step_2: its base {url}/step_1 is not there"), err.value
        assert "\n" not in str(err.value)
    s3.put_folder("never/step_3", root / "step_3")  # its base was never uploaded
    with pytest.raises(LayerwiseError, match=f"never/step_3: its base s3://{BUCKET}/never/step_2 is not there"):
        open_step(f"s3://{BUCKET}/never/step_3")


def test_an_object_rewritten_mid_chain_is_refused(s3, run, env, tmp_path) -> None:
    root, steps = run
    url = _upload(s3, root, "rewritten")
    pinned = open_step(f"{url}/step_3").revision
    # The trainer writes step_2 again (another step from step_1) after the operation pinned the chain.
    other = {n: rl_step(t, 0.03, 77) for n, t in steps["step_1"].items()}
    save_checkpoint(other.items(), tmp_path / "step_2", config={"model_type": "llama"}, marker=None,
                    base=root / "step_1")
    s3.put_folder("rewritten/step_2", tmp_path / "step_2")
    with pytest.raises(LayerwiseError, match="the chain's objects changed since this operation pinned them") as err:
        open_step(f"{url}/step_3", pinned)
    assert str(err.value).startswith(f"{url}/step_3: ") and "\n" not in str(err.value)
    # Read afresh, step_3's base is no longer the step it was written against.
    with pytest.raises(LayerwiseError, match=f"its base {url}/step_2 is not the delta's base: tensor"):
        open_step(f"{url}/step_3")


def test_inspect_order_describes_a_delta_step_by_url(s3, run, env) -> None:
    root, _ = run
    url = _upload(s3, root, "inspected")
    done = CliRunner().invoke(app, ["inspect-order", f"{url}/step_3", "--json"])
    assert done.exit_code == 0, done.output
    delta = json.loads(done.stdout)["delta"]
    assert delta is not None and delta["base"] == str(root / "step_2")


def _size(root: Path, *names: str, suffix: str = "") -> int:
    return sum(p.stat().st_size for name in names for p in (root / name).iterdir()
               if p.is_file() and p.name.endswith(suffix))


def test_a_client_pins_the_chain_from_headers_alone(s3, run, env, tmp_path, monkeypatch) -> None:
    root, _ = run
    url = _upload(s3, root, "pinned")
    pin = store_revision(f"{url}/step_3", None)
    assert not (tmp_path / "cache").exists()  # nothing fetched or kept: the client only reads headers
    assert open_step(f"{url}/step_3", pin).revision == pin
    assert store_revision(f"{url}/step_1", None) == open_step(f"{url}/step_1").revision


def test_a_server_off_the_chain_is_told_so(run) -> None:
    """`off_chain_note`: None while every layer's record names a step of the chain (its full step, a link's base,
    the step itself); a note naming the layers otherwise (what `watch`'s reload_done event then carries)."""
    root, _ = run
    chain = open_step(str(root / "step_3")).delta
    stream = [PlannedTensor(entry, entry.name.rsplit(".", 1)[0]) for entry in open_step(str(root / "step_3")).tensors]

    def records(digests_of) -> LayerRecords:
        found = LayerRecords()
        for item in stream:
            digest = layer_digest({item.entry.name: digests_of[item.entry.name]})
            found.set(item.parent, LayerRecord(digest, None, True))
        return found

    for step in (chain.links[0].base_digests, chain.links[1].base_digests, chain.last.step_digests):
        assert off_chain_note(chain, stream, records(step)) is None
    mixed = records(chain.links[0].base_digests)
    mixed.drop(stream[0].parent)  # a layer the server never loaded with layerwise
    note = off_chain_note(chain, stream, mixed)
    assert note.startswith(f"{OFF_CHAIN_NOTE} in 1 of {len(stream)} layers (first {stream[0].parent}): given its "
                           f"full step ({root / 'step_1'}")
