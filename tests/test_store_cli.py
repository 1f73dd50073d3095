"""Sources by URL for real: `inspect-order s3://...` against SeaweedFS on loopback (`tests/support/seaweed.py`).

The headers are read by range (the server never sends tensor data); a missing key, a missing bucket and wrong
credentials are one line each, naming the object and never a credential.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.fetch.range_fetcher import RangeFetcher, whole_files
from layerwise_cli.checkpoint.store.objects import StoreSource, store_cache_folder
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from tests.support.drop_proxy import DropProxy
from tests.support.https_server import HttpsFolder
from tests.support.seaweed import BUCKET, SECRET_KEY, SeaweedS3, running_seaweed
from tests.support.server_support import free_port
from tests.support.synthetic import SyntheticModel, write_checkpoint

DENSE = SyntheticModel(layers=3, hidden=128, intermediate=256, vocab=256)


@pytest.fixture(scope="module")
def s3() -> SeaweedS3:
    with running_seaweed() as server:
        yield server


@pytest.fixture(scope="module")
def sharded(s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp("store") / "dense"
    write_checkpoint(folder, DENSE, "trainer_export", 3)
    return s3.put_folder("run/step_1", folder), folder


@pytest.fixture
def store_env(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def inspect(*args: str):
    return CliRunner().invoke(app, ["inspect-order", *args, "--json", "--top", "0"])


def test_inspect_order_reads_an_s3_prefix_like_the_local_folder(store_env, sharded) -> None:
    url, folder = sharded
    remote, local = inspect(url), inspect(str(folder))
    assert remote.exit_code == 0, remote.output
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got["source"] == url
    assert got["tensors"] == want["tensors"] and got["layers"] == want["layers"]
    # Only headers were read: a few KB of a checkpoint of about a MB.
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert 0 < got["header_bytes_read"] < weights / 20


@pytest.mark.parametrize(("case", "url", "env", "message"), [
    ("missing key", f"s3://{BUCKET}/run/no_such_step", {},
     f"s3://{BUCKET}/run/no_such_step: no model.safetensors or model.safetensors.index.json under the prefix"),
    ("missing bucket", "s3://no-such-bucket/run/step_1", {}, "s3://no-such-bucket/run/step_1: no such bucket"),
    ("wrong credentials", f"s3://{BUCKET}/run/step_1", {"AWS_SECRET_ACCESS_KEY": "wrong-secret"},
     f"s3://{BUCKET}/run/step_1/config.json: access denied"),
    ("unreachable store", f"s3://{BUCKET}/run/step_1", {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
     f"s3://{BUCKET}/run/step_1/config.json: cannot reach the store"),
])
def test_store_failures_are_one_line_naming_the_object(store_env, sharded, monkeypatch, case, url, env,
                                                       message) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = inspect(url)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {message}"), result.stderr
    assert SECRET_KEY not in result.output and "wrong-secret" not in result.output


def test_inspect_order_reads_an_https_folder_with_a_private_certificate_authority(sharded, monkeypatch) -> None:
    _url, folder = sharded
    with HttpsFolder(folder) as server:
        monkeypatch.setenv("SSL_CERT_FILE", str(server.ca_file))
        remote = inspect(server.url + "/")
        assert remote.exit_code == 0, remote.output
        got, want = json.loads(remote.stdout), json.loads(inspect(str(folder)).stdout)
        assert got["tensors"] == want["tensors"] and got["layers"] == want["layers"]
        # Headers only: far less than the weights were sent.
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        assert 0 < sum(n for name, n in server.sent.items() if name.endswith(".safetensors")) < weights / 20
        # Not trusted without the authority: one line naming the object.
        monkeypatch.delenv("SSL_CERT_FILE")
        refused = inspect(server.url + "/")
        assert refused.exit_code == 1 and refused.stderr.count("Error:") == 1, refused.output


def test_a_dropped_connection_resumes_and_every_byte_arrives_once(store_env, sharded, monkeypatch) -> None:
    url, folder = sharded
    shard = sorted(folder.glob("*.safetensors"))[-1]
    proxy = DropProxy(store_env.port, cut_after=shard.stat().st_size // 3, drops=2)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        # One connection, one part: each drop cuts the body of the one request in flight.
        with RangeFetcher(StoreSource(url), whole_files({shard.name: shard.stat().st_size}), connections=1,
                          part_bytes=shard.stat().st_size, keep=False) as fetcher:
            fetcher.check()
            got = fetcher.read(shard.name, 0, shard.stat().st_size)
            fetched = fetcher.bytes_fetched
    finally:
        proxy.close()
    assert proxy.dropped >= 1
    assert got == shard.read_bytes()
    assert fetched == shard.stat().st_size  # resumed at the last byte received: none fetched twice


def test_a_stalled_body_fails_as_one_line_naming_the_object(sharded) -> None:
    """Bytes stop in the middle of a shard and the connection stays open: no byte for the stall bound (obstore's
    read timeout, retried, then layerwise's) fails the fetch, naming the object, rather than waiting for ever."""
    _url, folder = sharded
    shard = sorted(folder.glob("*.safetensors"))[-1]
    size = shard.stat().st_size
    with HttpsFolder(folder) as server, pytest.MonkeyPatch.context() as patch:
        patch.setenv("SSL_CERT_FILE", str(server.ca_file))
        server.stalls[shard.name] = size // 2
        source = StoreSource(server.url, policy=FetchPolicy(stall_s=0.5, retries=1, backoff_s=0.05))
        with RangeFetcher(source, whole_files({shard.name: size}), connections=1, part_bytes=size,
                          keep=False) as fetcher, pytest.raises(LayerwiseError) as caught:
            fetcher.check()
        sent = server.sent[shard.name]
    assert str(caught.value) == f"{server.url}/{shard.name}: no bytes for 0.5 s: the fetch stalled"
    assert 0 < sent < size  # the body stalled in the middle, not before it began


def test_reorder_from_s3_writes_what_reorder_from_the_local_folder_writes(store_env, sharded, tmp_path) -> None:
    url, folder = sharded
    runner = CliRunner()
    remote = runner.invoke(app, ["reorder", url, str(tmp_path / "remote"), "--verify", "--json"])
    assert remote.exit_code == 0, remote.output
    local = runner.invoke(app, ["reorder", str(folder), str(tmp_path / "local"), "--verify", "--json"])
    assert local.exit_code == 0, local.output
    report = json.loads(remote.stdout)
    assert report["revision"].startswith("etags:") and report["verified"] is True
    written = {p.name: p.read_bytes() for p in (tmp_path / "remote").iterdir()}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert "config.json" in written and not list(tmp_path.glob(".remote*"))  # no fetched file left beside it


def test_reorder_refuses_an_object_overwritten_during_the_copy(store_env, sharded, tmp_path, monkeypatch) -> None:
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    _url, folder = sharded
    url = store_env.put_folder("run/overwritten", folder)
    shard = sorted(folder.glob("*.safetensors"))[-1].name
    fetch, overwritten = StoreSource.fetch, []

    def overwrite_first(self, filename, identity, start, end, write):
        # The trainer rewrites a shard after reorder read the headers and pinned the ETags.
        if not overwritten:
            obstore.put(store_env.objects("run/overwritten"), shard, (folder / shard).read_bytes() + b" ")
            overwritten.append(shard)
        return fetch(self, filename, identity, start, end, write)

    monkeypatch.setattr(StoreSource, "fetch", overwrite_first)
    done = CliRunner().invoke(app, ["reorder", url, str(tmp_path / "out")])
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.exit_code == 1 and overwritten and len(errors) == 1, done.output
    assert "the object changed since" in errors[0] and f"{url}/" in errors[0], errors
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_fetched_objects_are_cached_by_their_etag_and_bounded_disk_keeps_nothing(store_env, sharded, tmp_path,
                                                                                   monkeypatch) -> None:
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    _url, folder = sharded
    url = store_env.put_folder("run/cached", folder)
    shard = sorted(folder.glob("*.safetensors"))[-1]

    def fetch(keep: bool) -> tuple[bytes, int]:
        size = StoreSource(url).metadata(shard.name)[1]
        with RangeFetcher(StoreSource(url), whole_files({shard.name: size}), keep=keep) as fetcher:
            fetcher.check()
            return fetcher.read(shard.name, 0, size), fetcher.bytes_fetched

    def kept() -> list[int]:
        blobs = store_cache_folder(url) / "blobs"
        return sorted(p.stat().st_size for p in blobs.iterdir()) if blobs.is_dir() else []

    # Bounded disk: fetched, nothing kept.
    assert fetch(keep=False) == (shard.read_bytes(), shard.stat().st_size)
    assert kept() == []
    # Kept: the next fetch at the same ETag reads the cache, fetching nothing.
    assert fetch(keep=True) == (shard.read_bytes(), shard.stat().st_size)
    assert kept() == [shard.stat().st_size]
    assert fetch(keep=True) == (shard.read_bytes(), 0)
    # The object rewritten: another ETag, another key: fetched again, never the old bytes.
    changed = shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1])
    obstore.put(store_env.objects("run/cached"), shard.name, changed)
    assert fetch(keep=True) == (changed, len(changed))
    assert kept() == [shard.stat().st_size, len(changed)]


def test_reorder_reads_the_shards_a_fetch_kept_whole_in_the_store_cache(store_env, sharded, tmp_path,
                                                                        monkeypatch) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    _url, folder = sharded
    url = store_env.put_folder("run/reorder-cached", folder)
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    with RangeFetcher(StoreSource(url), whole_files(sizes), keep=True) as fetcher:  # a reload's fetch, kept
        fetcher.check()
    fetch, fetched = StoreSource.fetch, []

    def counted(self, filename, identity, start, end, write):
        fetched.append(filename)
        return fetch(self, filename, identity, start, end, write)

    monkeypatch.setattr(StoreSource, "fetch", counted)
    runner = CliRunner()
    done = runner.invoke(app, ["reorder", url, str(tmp_path / "remote"), "--verify"])
    assert done.exit_code == 0, done.output
    assert fetched == []  # every shard read from the cache
    assert runner.invoke(app, ["reorder", str(folder), str(tmp_path / "local")]).exit_code == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "remote").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    # The cache is left as it was: the shards, whole, nothing deleted or added.
    assert sorted(p.stat().st_size for p in (tmp_path / "cache").rglob("blobs/*")) == sorted(sizes.values())
