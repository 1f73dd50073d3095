"""`layerwise reorder --digests`: header digests taken from the bytes as they are copied, and digests that lie.

Digests are checked here against an independent computation (xxhash on the
bytes the safetensors library returns), never against what reorder returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import layerwise_cli.reorder.write as write
from layerwise_cli.checkpoint.format import chunks
from layerwise_cli.checkpoint.format.digests import METADATA_KEY, digests_metadata, header_digests
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry, read_shard_header
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.reorder.rewrite import reorder
from layerwise_cli.writer.save import save_checkpoint
from tests.support.digest_support import corrupt_header_digest, independent_digests
from tests.support.hub_server import HubServer
from tests.support.small_qwen3 import CONFIG, qwen3_like, shuffled

runner = CliRunner()

def _header_digests(folder: Path) -> dict[str, dict[str, str] | None]:
    return {p.name: header_digests(read_shard_header(p)[0]) for p in sorted(folder.glob("*.safetensors"))}


def _invoke(*args: str):
    return runner.invoke(app, ["reorder", *args])


def _error_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("Error:")]
    return line


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".layerwise-" in p.name]


@pytest.fixture
def written(tmp_path: Path) -> Path:
    """The writer's output: 23 small shards, each carrying its own digests."""
    save_checkpoint(shuffled(qwen3_like(), 3), tmp_path / "step_1", config=CONFIG, max_shard_size=6000)
    return tmp_path / "step_1"


@pytest.mark.parametrize(("layout", "shape"), [("trainer_export", {"layers": 3}),
                                               ("experts_spread", {"layers": 2, "experts": 4}),
                                               ("trainer_export", {"layers": 2, "vocab": 160})],
                         ids=["dense", "moe", "padded-vocab"])
def test_every_shard_carries_the_digest_of_its_tensors_bytes(make_checkpoint, tmp_path, layout, shape):
    src = make_checkpoint(layout, **shape)
    assert set(_header_digests(src).values()) == {None}
    dst = tmp_path / "dst"
    result = reorder(str(src), dst, max_shard_size=20 * 1024)
    assert result.digests and result.source_digests_checked == 0
    assert len(result.shards) > 2
    headers = _header_digests(dst)
    assert None not in headers.values()
    carried = {name: digest for digests in headers.values() for name, digest in digests.items()}
    assert carried == independent_digests(dst) == independent_digests(src)
    # inspect-order --scan re-hashes every tensor against them.
    scan = runner.invoke(app, ["inspect-order", str(dst), "--scan", "--json"])
    assert scan.exit_code == 0, scan.stderr
    data = json.loads(scan.stdout)
    assert data["scan"]["digests_checked"] == len(carried) and data["scan"]["digest_mismatches"] == []
    assert data["header_digests"]["shards_with_digests"] == len(headers)


def test_the_writers_digests_are_checked_and_rewritten_per_shard(written, tmp_path):
    dst = tmp_path / "dst"
    result = _invoke(str(written), str(dst), "--max-shard-size", "9000", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["digests"] is True and data["source_digests_checked"] == data["tensors"] == 36
    # Each new shard names its own tensors (the source's per-shard key is not carried over), and the
    # source's merged metadata does not report the per-shard digests as a conflict.
    assert METADATA_KEY not in data["metadata_conflicts"]
    for path in sorted(dst.glob("*.safetensors")):
        header = read_shard_header(path)[0]
        assert set(header_digests(header)) == {t.name for t in header.tensors}
        assert header.metadata["format"] == "pt"
    # The same tensors and so the same per-layer digests as the writer's, on fewer shards.
    before = json.loads(runner.invoke(app, ["inspect-order", str(written), "--json", "--top", "0"]).stdout)
    after = json.loads(runner.invoke(app, ["inspect-order", str(dst), "--json", "--top", "0"]).stdout)
    assert after["shards"] < before["shards"]
    assert after["header_digests"]["tensors"] == before["header_digests"]["tensors"] == independent_digests(dst)
    assert ({row["name"]: row["digest"] for row in after["layers"]}
            == {row["name"]: row["digest"] for row in before["layers"]})
    table = _invoke(str(written), str(tmp_path / "table"), "--max-shard-size", "9000")
    assert "layerwise.digests (xxh3-128) in every shard header; the source's header digests matched its " \
           "bytes (36 tensors)" in table.stdout


def test_no_digests_writes_none_and_drops_the_sources(written, tmp_path):
    dst = tmp_path / "dst"
    result = _invoke(str(written), str(dst), "--no-digests", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["digests"] is False and data["source_digests_checked"] == 0
    assert set(_header_digests(dst).values()) == {None}
    assert all(read_shard_header(p)[0].metadata == {"format": "pt"} for p in dst.glob("*.safetensors"))
    table = _invoke(str(written), str(tmp_path / "table"), "--no-digests")
    assert "none written (--no-digests)" in table.stdout


def test_a_source_digest_that_lies_is_refused(written, tmp_path):
    shard = sorted(written.glob("*.safetensors"))[4]
    tensor = read_shard_header(shard)[0].tensors[0].name
    wrong = corrupt_header_digest(shard, tensor)
    for options in ([], ["--verify"], ["--no-digests", "--verify"]):
        dst = tmp_path / "dst"
        result = _invoke(str(written), str(dst), *options)
        assert result.exit_code == 1, options
        line = _error_line(result.stderr)
        assert line.startswith(f"Error: {shard}: tensor {tensor}: its bytes do not match the {METADATA_KEY} "
                               f"digest in the header (header {wrong}, bytes "), (options, line)
        assert line.endswith("the source is corrupt or its digests are wrong; nothing was put in place")
        assert not dst.exists() and not _leftovers(tmp_path)
    # Without digests and without --verify nothing is hashed: the source's claims are dropped, not copied.
    result = _invoke(str(written), str(tmp_path / "unchecked"), "--no-digests")
    assert result.exit_code == 0, result.stderr
    assert set(_header_digests(tmp_path / "unchecked").values()) == {None}


def test_a_changed_byte_under_a_source_digest_is_refused(written, tmp_path):
    shard = sorted(written.glob("*.safetensors"))[7]
    header, _ = read_shard_header(shard)
    entry = header.tensors[-1]
    raw = bytearray(shard.read_bytes())
    raw[header.data_start + entry.end - 1] ^= 0x01  # a low mantissa bit of the last element: still finite
    shard.write_bytes(bytes(raw))
    dst = tmp_path / "dst"
    result = _invoke(str(written), str(dst))
    assert result.exit_code == 1
    assert _error_line(result.stderr).startswith(f"Error: {shard}: tensor {entry.name}: its bytes do not match")
    assert not dst.exists() and not _leftovers(tmp_path)


def _corrupt_one_data_write(monkeypatch) -> dict:
    real = write.write_chunk
    state = {"done": False}

    def corrupt_once(fd: int, data, offset: int) -> None:
        if offset > 0 and len(data) > 64 and not state["done"]:  # tensor data, not a header
            state["done"] = True
            data = bytes([data[0] ^ 0x01]) + bytes(data[1:])
        real(fd, data, offset)

    monkeypatch.setattr(write, "write_chunk", corrupt_once)
    return state


def test_a_corrupted_write_is_caught_by_verify_and_by_scan(make_checkpoint, tmp_path, monkeypatch):
    src = make_checkpoint("trainer_export", layers=3)
    state = _corrupt_one_data_write(monkeypatch)
    unchecked = tmp_path / "unchecked"
    assert _invoke(str(src), str(unchecked)).exit_code == 0  # without --verify only the headers are checked
    assert state["done"]
    # The header digests were taken from the source's bytes, so they expose the written byte that differs.
    scan = runner.invoke(app, ["inspect-order", str(unchecked), "--scan"])
    assert scan.exit_code == 1
    assert "its bytes do not match the layerwise.digests digest in the header" in _error_line(scan.stderr)
    state["done"] = False
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst), "--verify")
    assert result.exit_code == 1
    assert "--verify: 1 tensor(s) differ from the source, first: " in _error_line(result.stderr)
    assert not dst.exists() and not _leftovers(tmp_path)


def test_a_header_patched_with_a_wrong_digest_is_refused(make_checkpoint, tmp_path, monkeypatch):
    src = make_checkpoint("trainer_export", layers=2)
    real = write._patch_header

    def wrong_digest(fd, shard, hashes, written_header, metadata, out):
        first = shard.tensors[0].name
        lied = {**hashes, first: ("0" if hashes[first][0] != "0" else "1") + hashes[first][1:]}
        real(fd, shard, lied, written_header, metadata, out)

    monkeypatch.setattr(write, "_patch_header", wrong_digest)
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst))
    assert result.exit_code == 1
    line = _error_line(result.stderr)
    assert "internal error" in line and f"{METADATA_KEY} digest of" in line
    assert "is not the one taken from the source's bytes" in line
    assert not dst.exists() and not _leftovers(tmp_path)


def test_an_unpatched_header_is_refused_by_every_reader(make_checkpoint, tmp_path, monkeypatch):
    # The placeholder a header holds until its shard is complete is no digest: a bug that left it would be
    # caught before the rename, and by any reader after.
    src = make_checkpoint("in_order", layers=2)
    monkeypatch.setattr(write, "_patch_header", lambda *args: None)
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst))
    assert result.exit_code == 1
    assert "is not 32 lowercase hex digits" in _error_line(result.stderr)
    assert not dst.exists() and not _leftovers(tmp_path)
    assert len(write.PLACEHOLDER) == 32
    shard = ShardHeader("x.safetensors", 0, None, digests_metadata({"w": write.PLACEHOLDER}),
                        (TensorEntry("w", "F32", (1,), "x.safetensors", 0, 4),))
    with pytest.raises(LayerwiseError, match="is not 32 lowercase hex digits"):
        header_digests(shard)


def test_digests_cost_no_second_read(make_checkpoint, tmp_path, monkeypatch):
    # The digest is taken in the copy loop: every source byte is read once, with or without digests.
    src = make_checkpoint("trainer_export", layers=3)
    real = chunks.read_chunks
    counts = {}

    def counting(fd, at, nbytes, buf, *, tensor, where):
        for view in real(fd, at, nbytes, buf, tensor=tensor, where=where):
            counts[where] = counts.get(where, 0) + len(view)
            yield view

    monkeypatch.setattr(write, "read_chunks", counting)
    tensor_bytes = {str(p): sum(t.nbytes for t in read_shard_header(p)[0].tensors) for p in src.glob("*.safetensors")}
    for digests in (False, True):
        counts.clear()
        result = reorder(str(src), tmp_path / f"dst-{digests}", digests=digests)
        assert result.digests is digests
        assert counts == tensor_bytes  # each source shard's tensor bytes, once


def test_a_lying_digest_in_a_hub_repo_is_refused_naming_the_repo_file(written, tmp_path):
    shard = sorted(written.glob("*.safetensors"))[2]
    tensor = read_shard_header(shard)[0].tensors[0].name
    corrupt_header_digest(shard, tensor)
    with HubServer() as hub:
        hub.add_repo("org/liar", written)
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"),
               "HF_HUB_DISABLE_XET": "1"}
        done = subprocess.run([sys.executable, "-m", "layerwise_cli", "reorder", "org/liar", str(tmp_path / "dst"),
                               "--json"], capture_output=True, text=True, env=env, check=False,
                              cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 1, done.stdout
    assert _error_line(done.stderr).startswith(f"Error: org/liar/{shard.name}: tensor {tensor}: its bytes do not "
                                               "match")
    assert not (tmp_path / "dst").exists() and not _leftovers(tmp_path)
