"""A checkpoint in object storage streamed into a real engine by byte range: S3 (SeaweedFS) and HTTPS on loopback.

One engine in this process, started on a local step A (`tests/support/stream_steps.py`), reloads with the Python
API:

- B from `s3://ckpts/run/B`, with `verify`: equal to an engine started fresh on B (every tensor, and answers);
- A from S3 while the trainer overwrites a shard of it in the middle of the fetch: refused, naming the object,
  and the engine keeps B;
- a missing key, a missing bucket, wrong credentials: one line each, no credential in it, the engine keeps B;
- A from an HTTPS server with a private certificate authority: equal to a fresh engine on A;
- B from an HTTPS server whose shard stalls mid-body: fails within the stall bound (`LAYERWISE_STALL_S`),
  naming the object, and the engine keeps A;
- B again from a prefix of its own: with bounded disk nothing is kept; kept, a reload at the same ETags reads the
  store cache and fetches nothing, equal to a fresh engine on B;
- `watch` on a bucket prefix: the newest complete step loaded at its pin, an incomplete one after it not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import layerwise_cli
from layerwise_cli.checkpoint.fetch.policy import STALL_ENV
from layerwise_cli.checkpoint.store.objects import StoreSource, store_cache_folder
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import (
    assert_is_fresh,
    assert_same_outputs,
    checksums,
    fresh_state,
    greedy_with_logprobs,
)
from tests.support.https_server import HttpsFolder
from tests.support.in_process import start_here, stop_here
from tests.support.seaweed import BUCKET, SECRET_KEY, running_seaweed
from tests.support.stream_steps import step_tensors, stream_prompts, write_step

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ckpts(demo_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("store-stream")
    tokenizer = demo_models["multiply"]
    return {"A": write_step(root / "A", step_tensors({}, 1), tokenizer),
            "B": write_step(root / "B", step_tensors({}, 2), tokenizer)}


@pytest.fixture(scope="module")
def s3(ckpts):
    with running_seaweed() as server, pytest.MonkeyPatch.context() as patch:
        for key, value in server.env().items():
            patch.setenv(key, value)
        server.put_folder("run/A", ckpts["A"])
        server.put_folder("run/B", ckpts["B"])
        yield server


@pytest.fixture(scope="module")
def fresh(ckpts) -> None:
    """Engines started fresh on A and B, before the engine under test starts: in this process (`start_here`),
    where one started beside it would start with processes of its own (30 s or more)."""
    for name in ("A", "B"):
        fresh_state(ckpts[name], stream_prompts())


@pytest.fixture(scope="module")
def engine(ckpts, s3, fresh):
    llm = start_here(str(ckpts["A"]))
    yield llm
    stop_here(llm)


def test_a_step_in_s3_streams_into_the_engine_equal_to_a_fresh_one(engine, s3, ckpts) -> None:
    # With verify: every layer of the engine is compared with B, read by range from the store at its pin.
    report = layerwise_cli.reload(engine, f"s3://{BUCKET}/run/B", verify=True)
    assert report.verify is not None and report.verify.ok and report.verify.checked > 0
    weights = sum(p.stat().st_size for p in ckpts["B"].glob("*.safetensors"))
    assert report.volume.fetched_bytes is not None and report.volume.bytes <= report.volume.fetched_bytes <= weights
    assert_is_fresh(engine, ckpts["B"], stream_prompts())


def test_an_object_overwritten_mid_fetch_is_refused_naming_it(engine, s3, ckpts, monkeypatch) -> None:
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    before = checksums(engine)
    shard = sorted(ckpts["A"].glob("*.safetensors"))[-1].name
    fetch, overwritten = StoreSource.fetch, []

    def overwrite_first(self, filename, identity, start, end, write):
        # The trainer rewrites the shard after the reload pinned its ETag and began fetching.
        if not overwritten:
            obstore.put(s3.objects("run/A"), shard, (ckpts["B"] / shard).read_bytes())
            overwritten.append(shard)
        return fetch(self, filename, identity, start, end, write)

    monkeypatch.setattr(StoreSource, "fetch", overwrite_first)
    try:
        with pytest.raises(LayerwiseError, match=f"s3://{BUCKET}/run/A/model-.*: the object changed since") as err:
            layerwise_cli.reload(engine, f"s3://{BUCKET}/run/A")
    finally:
        monkeypatch.setattr(StoreSource, "fetch", fetch)
        s3.put_folder("run/A", ckpts["A"])
    assert overwritten and "\n" not in str(err.value)
    assert checksums(engine) == before


@pytest.mark.parametrize(("url", "env", "message"), [
    (f"s3://{BUCKET}/run/missing", {}, "no model.safetensors or model.safetensors.index.json under the prefix"),
    ("s3://no-such-bucket/run/B", {}, "no such bucket"),
    (f"s3://{BUCKET}/run/B", {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access denied"),
])
def test_store_failures_leave_the_engine_as_it_was(engine, s3, monkeypatch, url, env, message) -> None:
    before = checksums(engine)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LayerwiseError, match=message) as err:
        layerwise_cli.reload(engine, url)
    text = str(err.value)
    assert "\n" not in text and SECRET_KEY not in text and "wrong-secret" not in text
    assert checksums(engine) == before


def test_a_step_over_https_streams_into_the_engine_equal_to_a_fresh_one(engine, ckpts, monkeypatch) -> None:
    with HttpsFolder(ckpts["A"]) as server:
        monkeypatch.setenv("SSL_CERT_FILE", str(server.ca_file))
        layerwise_cli.reload(engine, server.url)
        weights = sum(p.stat().st_size for p in ckpts["A"].glob("*.safetensors"))
        assert 0 < sum(n for name, n in server.sent.items() if name.endswith(".safetensors")) <= 1.05 * weights
    assert_is_fresh(engine, ckpts["A"], stream_prompts())


def test_a_stalled_body_fails_naming_the_object_and_the_engine_keeps_its_weights(engine, ckpts, monkeypatch) -> None:
    layerwise_cli.reload(engine, str(ckpts["A"]))  # every layer of B differs: its shards are fetched
    before, answers = checksums(engine), greedy_with_logprobs(engine, stream_prompts())
    shard = sorted(ckpts["B"].glob("*.safetensors"))[-1]
    monkeypatch.setenv(STALL_ENV, "1")
    with HttpsFolder(ckpts["B"]) as server:
        monkeypatch.setenv("SSL_CERT_FILE", str(server.ca_file))
        server.stalls[shard.name] = shard.stat().st_size // 2
        with pytest.raises(LayerwiseError) as err:
            layerwise_cli.reload(engine, server.url)
        assert 0 < server.sent[shard.name] < shard.stat().st_size
    assert str(err.value) == f"{server.url}/{shard.name}: no bytes for 1 s: the fetch stalled"
    assert checksums(engine) == before
    assert_same_outputs(greedy_with_logprobs(engine, stream_prompts()), answers, exact=True)


def test_a_reload_at_the_same_etags_reads_the_store_cache_and_bounded_disk_keeps_nothing(engine, s3, ckpts) -> None:
    url = s3.put_folder("run/B-cached", ckpts["B"])  # a prefix of its own: nothing of it cached yet
    blobs = store_cache_folder(url) / "blobs"

    def kept() -> list[int]:
        return sorted(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else []

    def from_a(**options):
        layerwise_cli.reload(engine, str(ckpts["A"]))  # every layer differs from B: all of B is handed over
        return layerwise_cli.reload(engine, url, **options)

    bounded = from_a(bounded_disk=True)
    assert bounded.volume.fetched_bytes and kept() == []
    first = from_a()
    shards = sorted(p.stat().st_size for p in ckpts["B"].glob("*.safetensors"))
    assert first.volume.fetched_bytes and kept() == shards  # each shard kept whole, under its ETag's key
    again = from_a()
    assert again.volume.fetched_bytes == 0  # read from the cache: nothing fetched
    assert_is_fresh(engine, ckpts["B"], stream_prompts())


def test_watch_keeps_an_in_process_engine_on_the_newest_step_in_a_bucket(engine, s3, ckpts) -> None:
    """`layerwise_cli.watch("s3://.../", llm=...)`: the newest complete step, loaded at its pin; one incomplete
    after it (its index names a shard not there) is not."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    layerwise_cli.reload(engine, str(ckpts["A"]))
    s3.put_folder("watched/step_1", ckpts["B"])
    store, shards = s3.objects("watched/step_2"), sorted(p.name for p in ckpts["A"].glob("*.safetensors"))
    for path in sorted(ckpts["A"].iterdir()):
        if path.is_file() and path.name != shards[-1]:
            obstore.put(store, path.name, path.read_bytes())
    events = list(layerwise_cli.watch(f"s3://{BUCKET}/watched/", llm=engine, once=True, settle=0, interval=0.1))
    assert [(e.kind, e.step) for e in events if e.kind in ("step_complete", "reload_done")] == [
        ("step_complete", "step_1"), ("reload_done", "step_1")]
    assert engine.get_weight_version() == "step_1"
    assert_is_fresh(engine, ckpts["B"], stream_prompts())
