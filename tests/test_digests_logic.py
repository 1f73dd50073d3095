"""Per-tensor and per-layer digests, and the header key that carries them (no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

from layerwise_cli.checkpoint.format.digests import (
    FORMAT,
    METADATA_KEY,
    TensorHasher,
    checkpoint_digests,
    digests_metadata,
    header_digests,
    layer_digest,
    layer_digests,
    tensor_digest,
)
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.errors import LayerwiseError


def test_tensor_digest_is_the_documented_xxh3_128():
    data = np.arange(6, dtype="<f4").tobytes()
    expected = xxhash.xxh3_128(b"F32[2,3]\n" + data).hexdigest()
    assert tensor_digest("F32", (2, 3), data) == expected
    assert len(expected) == 32
    assert tensor_digest("F32", (), np.float32(1).tobytes()) == xxhash.xxh3_128(b"F32[]\n" + b"\0\0\x80?").hexdigest()


def test_dtype_and_shape_change_the_digest_as_bytes_do():
    data = np.arange(6, dtype="<u2").tobytes()
    base = tensor_digest("BF16", (2, 3), data)
    assert tensor_digest("F16", (2, 3), data) != base
    assert tensor_digest("BF16", (3, 2), data) != base
    assert tensor_digest("BF16", (6,), data) != base
    flipped = bytearray(data)
    flipped[5] ^= 1
    assert tensor_digest("BF16", (2, 3), bytes(flipped)) != base


def test_chunked_hashing_equals_whole():
    data = np.random.default_rng(0).integers(0, 2**16, 10_001, dtype="<u2").tobytes()
    hasher = TensorHasher("BF16", (10_001,))
    for start in range(0, len(data), 777):
        hasher.update(memoryview(data)[start:start + 777])
    assert hasher.hexdigest() == tensor_digest("BF16", (10_001,), data)


def _shard(tmp_path, tensors: dict, metadata: dict | None, name="model.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path), metadata=metadata)
    return read_shard_header(path)[0]


def _digests_of(tensors: dict) -> dict[str, str]:
    return {n: tensor_digest("F32", a.shape, a.astype("<f4").tobytes()) for n, a in tensors.items()}


def test_header_round_trip(tmp_path):
    tensors = {"a.weight": np.ones((2, 2), np.float32), "b.weight": np.zeros(3, np.float32)}
    digests = _digests_of(tensors)
    meta = digests_metadata(digests)
    assert json.loads(meta[METADATA_KEY]) == {"format": FORMAT, "tensors": digests}
    shard = _shard(tmp_path, tensors, {"format": "pt", **meta})
    assert header_digests(shard) == digests
    assert checkpoint_digests([shard]) == digests


def test_no_key_or_another_format_reads_as_none(tmp_path):
    tensors = {"a.weight": np.ones(2, np.float32)}
    assert header_digests(_shard(tmp_path, tensors, {"format": "pt"})) is None
    later = json.dumps({"format": "blake3/v9", "tensors": {"a.weight": "zz"}})
    shard = _shard(tmp_path, tensors, {METADATA_KEY: later}, "b.safetensors")
    assert header_digests(shard) is None
    assert checkpoint_digests([shard]) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"tensors": {}}', 'has no "format"'),
        (json.dumps({"format": FORMAT, "tensors": []}), 'has no "tensors" object'),
        (json.dumps({"format": FORMAT, "tensors": {"a.weight": "ABC"}}), "is not 32 lowercase hex digits"),
        (json.dumps({"format": FORMAT, "tensors": {"a.weight": "0" * 32, "x": "0" * 32}}),
         "names tensor 'x', which the shard does not hold"),
        (json.dumps({"format": FORMAT, "tensors": {}}), "has no digest for tensor 'a.weight'"),
    ],
)
def test_malformed_key_is_a_one_line_error(tmp_path, value, message):
    shard = _shard(tmp_path, {"a.weight": np.ones(2, np.float32)}, {METADATA_KEY: value})
    with pytest.raises(LayerwiseError) as info:
        header_digests(shard, where="/ckpt/model.safetensors")
    assert message in str(info.value)
    assert str(info.value).startswith("/ckpt/model.safetensors: ")
    assert "\n" not in str(info.value)


def test_layer_digest_ignores_order_and_sees_every_change():
    one = {"l.q.weight": "11" * 16, "l.k.weight": "22" * 16}
    assert layer_digest(one) == layer_digest(dict(reversed(list(one.items()))))
    assert layer_digest({**one, "l.q.weight": "12" * 16}) != layer_digest(one)
    assert layer_digest({"l.q.weight": "11" * 16}) != layer_digest(one)
    assert layer_digest({"l.Q.weight": "11" * 16, "l.k.weight": "22" * 16}) != layer_digest(one)


def test_layer_digests_group_by_parent_and_leave_out_unloaded():
    tensors = {"m.layers.0.a": "11" * 16, "m.layers.0.b": "22" * 16, "m.layers.1.a": "33" * 16, "rot": "44" * 16}

    def parent(name: str) -> str | None:
        return None if name == "rot" else ".".join(name.split(".")[:3])

    got = layer_digests(tensors, parent)
    assert set(got) == {"m.layers.0", "m.layers.1"}
    assert got["m.layers.0"] == layer_digest({"m.layers.0.a": "11" * 16, "m.layers.0.b": "22" * 16})


def test_digests_do_not_import_torch():
    code = ("import sys; from layerwise_cli.checkpoint.format import digests as d; "
            "d.tensor_digest('F32', (1,), b'\\0\\0\\0\\0'); d.layer_digest({'a': '0' * 32}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
