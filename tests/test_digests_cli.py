"""`inspect-order` shows header digests, and `--scan` catches a header digest that does not match the bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.format.digests import METADATA_KEY, header_digests, layer_digest
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.cli.app import app
from layerwise_cli.writer.save import save_checkpoint
from tests.support.digest_support import corrupt_header_digest
from tests.support.small_qwen3 import CONFIG, qwen3_like, shuffled

runner = CliRunner()


@pytest.fixture
def written(tmp_path: Path) -> Path:
    save_checkpoint(shuffled(qwen3_like(), 7), tmp_path / "step_1", config=CONFIG, max_shard_size=6000)
    return tmp_path / "step_1"


def _json(*args: str, code: int = 0) -> dict:
    result = runner.invoke(app, ["inspect-order", *args, "--json"])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def test_inspect_order_shows_header_digests(written):
    data = _json(str(written), "--top", "0")
    digests = data["header_digests"]
    assert digests["key"] == METADATA_KEY and digests["shards_with_digests"] == data["shards"]
    from_headers: dict[str, str] = {}
    for path in sorted(written.glob("*.safetensors")):
        from_headers.update(header_digests(read_shard_header(path)[0]))
    assert digests["tensors"] == from_headers and len(from_headers) == data["tensors"]
    qkv = next(row for row in data["layers"] if row["name"] == "model.layers.1.self_attn.qkv_proj")
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert qkv["digest"] == layer_digest({n: from_headers[n] for n in names})
    assert all(row["digest"] for row in data["layers"])
    table = runner.invoke(app, ["inspect-order", str(written), "--top", "3"])
    assert table.exit_code == 0
    assert f"{METADATA_KEY} (xxh3-128/v1) in {data['shards']} of {data['shards']} shard(s)" in table.stdout
    assert qkv["digest"][:12] in runner.invoke(app, ["inspect-order", str(written), "--top", "0"]).stdout


def test_no_digests_no_column(make_checkpoint):
    folder = make_checkpoint()
    data = _json(str(folder))
    assert data["header_digests"]["shards_with_digests"] == 0 and data["header_digests"]["tensors"] == {}
    assert all(row["digest"] is None for row in data["layers"])
    out = runner.invoke(app, ["inspect-order", str(folder), "--scan"]).stdout
    assert "header digest" not in out and METADATA_KEY not in out and "┃ digest" not in out


def test_scan_confirms_matching_digests(written):
    scan = _json(str(written), "--scan")["scan"]
    assert scan["digests_checked"] == scan["tensors"] and scan["digest_mismatches"] == []
    out = runner.invoke(app, ["inspect-order", str(written), "--scan"]).stdout
    assert f"{scan['tensors']} header digest(s) match the bytes" in out


def test_scan_catches_a_wrong_header_digest(written):
    shard = sorted(written.glob("*.safetensors"))[2]
    tensor = read_shard_header(shard)[0].tensors[0].name
    wrong = corrupt_header_digest(shard, tensor)
    # Headers alone cannot tell: inspect-order shows the (wrong) digest and exits 0.
    assert _json(str(written))["header_digests"]["tensors"][tensor] == wrong
    result = runner.invoke(app, ["inspect-order", str(written), "--scan", "--json"])
    assert result.exit_code == 1
    scan = json.loads(result.stdout)["scan"]
    assert [(m["name"], m["expected"]) for m in scan["digest_mismatches"]] == [(tensor, wrong)]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert line.startswith(f"Error: {shard}: tensor {tensor}: its bytes do not match the {METADATA_KEY} digest")


def test_scan_catches_changed_bytes_under_a_digest(written):
    shard = sorted(written.glob("*.safetensors"))[1]
    header, _ = read_shard_header(shard)
    entry = header.tensors[0]
    raw = bytearray(shard.read_bytes())
    raw[header.data_start + entry.begin] ^= 0x01  # one mantissa bit: still finite
    shard.write_bytes(bytes(raw))
    result = runner.invoke(app, ["inspect-order", str(written), "--scan"])
    assert result.exit_code == 1
    assert f"{entry.name}: its bytes do not match" in result.stderr
    assert "1 of " in result.stdout and "header digest(s) do not match the bytes" in result.stdout


def test_malformed_digest_key_is_one_line(written):
    shard = sorted(written.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    header, _ = read_shard_header(shard)
    doc = json.loads(raw[8:header.data_start])
    doc["__metadata__"][METADATA_KEY] = json.dumps({"format": "xxh3-128/v1", "tensors": 0})
    body = json.dumps(doc).encode()
    body += b" " * (-len(body) % 8)
    shard.write_bytes(len(body).to_bytes(8, "little") + body + raw[header.data_start:])
    result = runner.invoke(app, ["inspect-order", str(written)])
    assert result.exit_code == 1
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert line == f'Error: {shard}: __metadata__ {METADATA_KEY} has no "tensors" object'
