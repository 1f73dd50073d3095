"""The Hub fetcher's own logic, without a server: pins, request plans, intervals, backoff, partial files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from layerwise_cli.checkpoint.fetch.partial_blob import PARTIAL_SUFFIX, RECORD_SUFFIX, PartialBlob, add_interval, covers
from layerwise_cli.checkpoint.fetch.policy import STALL_ENV, FetchPolicy
from layerwise_cli.checkpoint.fetch.range_fetcher import ByteRange, RangeFetcher, range_requests
from layerwise_cli.checkpoint.hub.pin import HubPin, is_commit
from layerwise_cli.checkpoint.hub.range_source import HubSource
from layerwise_cli.errors import LayerwiseError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_pin_string_form_round_trips_and_refuses_a_branch() -> None:
    pin = HubPin("org/model", COMMIT, "main")
    assert str(pin) == f"org/model@{COMMIT}"
    assert HubPin.parse(str(pin)) == HubPin("org/model", COMMIT)
    with pytest.raises(LayerwiseError, match=r"^org/model: not a 40-hex commit id: 'main'$"):
        HubPin("org/model", "main")
    with pytest.raises(LayerwiseError, match="not a pinned Hub source"):
        HubPin.parse("org/model@main")
    assert is_commit(COMMIT) and not is_commit(COMMIT[:12]) and not is_commit(None) and not is_commit("v1")


def test_neighbours_merge_in_hand_over_order_and_big_ranges_split() -> None:
    ranges = [ByteRange("a", 0, 10), ByteRange("a", 10, 20), ByteRange("b", 0, 5), ByteRange("a", 30, 40),
              ByteRange("a", 40, 45)]
    assert range_requests(ranges, part_bytes=100) == [ByteRange("a", 0, 20), ByteRange("b", 0, 5),
                                                  ByteRange("a", 30, 45)]
    assert range_requests([ByteRange("a", 0, 25)], part_bytes=10) == [ByteRange("a", 0, 10), ByteRange("a", 10, 20),
                                                                  ByteRange("a", 20, 25)]


def test_bytes_asked_twice_are_fetched_once() -> None:
    # A tied head read twice, and a range overlapping one fetched earlier: only the new bytes.
    ranges = [ByteRange("a", 0, 10), ByteRange("b", 0, 4), ByteRange("a", 0, 10), ByteRange("a", 5, 15)]
    assert range_requests(ranges, part_bytes=100) == [ByteRange("a", 0, 10), ByteRange("b", 0, 4),
                                                  ByteRange("a", 10, 15)]
    inside = [ByteRange("a", 0, 30), ByteRange("b", 0, 1), ByteRange("a", 5, 40)]
    assert range_requests(inside, part_bytes=100) == [ByteRange("a", 0, 30), ByteRange("b", 0, 1),
                                                  ByteRange("a", 30, 40)]
    assert range_requests([ByteRange("a", 3, 3)], part_bytes=10) == []


def test_intervals_merge_and_cover() -> None:
    got: list[tuple[int, int]] = []
    for start, end in [(10, 20), (0, 5), (5, 10), (30, 40)]:
        got = add_interval(got, start, end)
    assert got == [(0, 20), (30, 40)]
    assert covers(got, 2, 20) and covers(got, 30, 30) and not covers(got, 15, 31) and not covers(got, 20, 21)


def test_backoff_doubles_to_a_bound_and_honours_retry_after() -> None:
    policy = FetchPolicy(backoff_s=0.5, max_backoff_s=3)
    assert [policy.wait_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1, 2, 3, 3]
    assert policy.wait_s(1, "2") == 2 and policy.wait_s(1, "60") == 3 and policy.wait_s(2, "soon") == 1


def test_the_stall_bound_comes_from_its_variable_and_a_bad_one_is_one_line(monkeypatch) -> None:
    monkeypatch.delenv(STALL_ENV, raising=False)
    assert FetchPolicy().stall_s == 60
    monkeypatch.setenv(STALL_ENV, "0.5")
    assert FetchPolicy().stall_s == 0.5 and FetchPolicy(stall_s=7).stall_s == 7
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(STALL_ENV, bad)
        with pytest.raises(LayerwiseError) as caught:
            FetchPolicy()
        assert str(caught.value) == f"{STALL_ENV}: {bad!r} is not a positive number of seconds"


def _blob(folder: Path, data: bytes, *, keep: bool = True) -> PartialBlob:
    etag = hashlib.sha256(data).hexdigest()
    return PartialBlob(folder, "model.safetensors", etag, len(data), keep=keep, where="org/m@c/model.safetensors")


def test_a_partial_file_is_recorded_resumed_verified_and_linked(tmp_path: Path) -> None:
    data = os.urandom(1000)
    blob = _blob(tmp_path, data)
    assert blob.path.name.endswith(PARTIAL_SUFFIX) and blob.kept
    blob.write(100, data[100:400])
    blob.mark(100, 400)
    blob.close()  # as a killed process leaves it: the partial file and its record
    again = _blob(tmp_path, data)
    assert again.received == [(100, 400)]
    for start, end in [(0, 100), (400, 1000)]:
        again.write(start, data[start:end])
        again.mark(start, end)
    again.finish(COMMIT)
    pointer = tmp_path / "snapshots" / COMMIT / "model.safetensors"
    assert pointer.is_symlink() and not os.readlink(pointer).startswith("/") and pointer.read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [again.etag]
    again.close()


def test_a_record_that_does_not_match_its_file_is_discarded(tmp_path: Path) -> None:
    data = os.urandom(500)
    blob = _blob(tmp_path, data)
    blob.write(0, data[:200])
    blob.mark(0, 200)
    blob.close()
    record = tmp_path / "blobs" / f"{blob.etag}{RECORD_SUFFIX}"
    record.write_text(json.dumps({"etag": blob.etag, "size": 999, "received": [[0, 200]]}))
    again = _blob(tmp_path, data)
    assert again.received == [] and not record.exists()
    again.close()


def test_bytes_that_do_not_match_the_sha256_are_refused_and_never_linked(tmp_path: Path) -> None:
    data = os.urandom(300)
    blob = _blob(tmp_path, data)
    blob.write(0, b"\0" + data[1:])
    blob.mark(0, 300)
    with pytest.raises(LayerwiseError, match=r"^org/m@c/model.safetensors: the bytes fetched do not match the Hub's "
                                             rf"sha256 {blob.etag} \(got [0-9a-f]{{64}}\)$"):
        blob.finish(COMMIT)
    assert not (tmp_path / "snapshots").exists() and list((tmp_path / "blobs").iterdir()) == []
    blob.close()


def test_a_second_process_on_the_same_blob_gets_a_private_file(tmp_path: Path) -> None:
    data = os.urandom(64)
    first = _blob(tmp_path, data)
    second = _blob(tmp_path, data)  # another open file description: flock conflicts as across processes
    assert first.kept and not second.kept and tmp_path not in second.path.parents
    second.write(0, data)
    second.mark(0, 64)
    second.finish(COMMIT)  # bounded: never linked
    assert not (tmp_path / "snapshots").exists()
    private = second.path.parent
    second.close()
    first.close()
    assert not private.exists()


def test_bounded_disk_keeps_nothing(tmp_path: Path) -> None:
    data = os.urandom(64)
    blob = _blob(tmp_path, data, keep=False)
    blob.write(0, data[:10])
    blob.mark(0, 10)
    private = blob.path.parent
    assert os.pread(blob.fd, 10, 0) == data[:10]
    blob.close()
    assert not private.exists() and not (tmp_path / "blobs").exists()



def test_a_cache_that_cannot_hold_the_lock_gets_a_private_file(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--m"
    (tmp_path / ".locks").write_text("a file where the lock folder goes")  # fails as a read-only cache does
    blob = _blob(repo, b"abc")
    assert not blob.kept and repo not in blob.path.parents
    blob.close()


def test_a_reader_going_back_within_a_file_finds_the_parts_it_asked_for(tmp_path) -> None:
    # Layer order reads a shard's tensors out of offset order (a large layer moved inward, names sorted).
    ranges = [ByteRange("a", 300, 400), ByteRange("a", 0, 50), ByteRange("b", 0, 10), ByteRange("a", 100, 200)]
    fetcher = RangeFetcher(HubSource(HubPin("org/m", "0" * 40), cache_dir=tmp_path), ranges, part_bytes=1 << 20)
    for wanted in ranges:
        found = [fetcher.parts[i] for i in fetcher._parts_for(wanted.filename, wanted.start, wanted.end)]
        assert found == [wanted]
    with pytest.raises(LayerwiseError, match="not in the fetch plan"):
        fetcher._parts_for("a", 50, 100)
