"""`save_checkpoint`: layer order from any input order, header digests, atomic commit, marker last, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import layerwise_cli
from layerwise_cli.checkpoint.format.digests import header_digests, tensor_digest
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.sources import INDEX_NAME, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.writer import save as save_module
from layerwise_cli.writer.save import save_checkpoint
from tests.support.small_qwen3 import CONFIG, qwen3_like, shuffled


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_round_trip_in_shuffled_order_is_exact_and_deterministic(tmp_path):
    sd = qwen3_like()
    first = save_checkpoint(shuffled(sd, 1), tmp_path / "a", config=CONFIG, max_shard_size=6000)
    second = save_checkpoint(shuffled(sd, 2), tmp_path / "b", config=CONFIG, max_shard_size=6000)
    got = loaded(tmp_path / "a")
    assert set(got) == set(sd)
    for name, tensor in sd.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert len(first.shards) > 3
    # Any input order gives the same files, byte for byte.
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert second.shards == first.shards
    index = json.loads((tmp_path / "a" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == CONFIG
    with safe_open(tmp_path / "a" / first.shards[0], "pt") as f:
        assert f.metadata()["format"] == "pt"


def test_vllm_read_order_buffers_one_layer(tmp_path):
    saved = save_checkpoint(shuffled(qwen3_like(), 3), tmp_path / "c", config=CONFIG, max_shard_size=6000)
    report = inspect_order(str(tmp_path / "c"))
    largest = report.plan.largest_layer_bytes
    assert report.plan.mapping.kind == "table"
    assert len(report.plan.checkpoint.shards) > 3
    peak = report.file_order_buffering.peak_buffer_bytes
    assert peak == largest == saved.peak_buffer_bytes == saved.largest_layer_bytes
    # A layer larger than a shard gets consecutive shards of its own; any other lives in one shard.
    assert any(layer.bytes > 6000 for layer in report.plan.layers)
    assert all(len(layer.shards) == 1 for layer in report.plan.layers if layer.bytes <= 6000)


def test_the_same_checkpoint_reshuffled_by_a_naive_writer_is_worse(tmp_path):
    """The test above can fail: writing the same tensors in arrival order buffers more than one layer."""
    sd = qwen3_like()
    items = list(shuffled(sd, 3))
    folder = tmp_path / "naive"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    for i in range(0, len(items), 6):
        save_file(dict(items[i:i + 6]), folder / f"model-{i // 6 + 1:05d}-of-99999.safetensors")
    report = inspect_order(str(folder))
    assert report.file_order_buffering.peak_buffer_bytes > report.plan.largest_layer_bytes


def test_headers_carry_the_digest_of_each_tensors_bytes(tmp_path):
    saved = save_checkpoint(shuffled(qwen3_like(), 4), tmp_path / "d", config=CONFIG, max_shard_size=6000)
    seen = set()
    for shard_name in saved.shards:
        path = tmp_path / "d" / shard_name
        header, _ = read_shard_header(path)
        digests = header_digests(header)
        assert digests is not None and set(digests) == {t.name for t in header.tensors}
        raw = path.read_bytes()
        for entry in header.tensors:
            data = raw[header.data_start + entry.begin:header.data_start + entry.end]
            assert digests[entry.name] == tensor_digest(entry.dtype, entry.shape, data), entry.name
            seen.add(entry.name)
    assert len(seen) == saved.tensors


def test_without_a_config_layers_group_by_index(tmp_path):
    sd = qwen3_like()
    save_checkpoint(shuffled(sd, 5), tmp_path / "e", max_shard_size=6000)
    assert not (tmp_path / "e" / "config.json").exists()
    report = inspect_order(str(tmp_path / "e"))
    assert report.plan.mapping.kind == "generic"
    assert report.file_order_buffering.peak_buffer_bytes == report.plan.largest_layer_bytes
    assert torch.equal(loaded(tmp_path / "e")["model.layers.2.mlp.up_proj.weight"],
                       sd["model.layers.2.mlp.up_proj.weight"])


def test_marker_is_written_last_into_the_complete_directory(tmp_path, monkeypatch):
    seen = {}
    real = save_module._write_marker

    def spy(dst: Path, marker: str) -> Path:
        seen["files"] = sorted(p.name for p in dst.iterdir())
        seen["checkpoint"] = open_checkpoint(str(dst))  # complete and valid before the marker
        seen["siblings"] = sorted(p.name for p in dst.parent.iterdir())
        return real(dst, marker)

    monkeypatch.setattr(save_module, "_write_marker", spy)
    saved = layerwise_cli.save_checkpoint(shuffled(qwen3_like(), 6), tmp_path / "step_7", config=CONFIG,
                                          max_shard_size=6000, marker="DONE")
    assert "DONE" not in seen["files"] and INDEX_NAME in seen["files"]
    assert len(seen["checkpoint"].tensors) == saved.tensors
    assert seen["siblings"] == ["step_7"]  # the temporary directory was renamed, nothing left beside it
    assert saved.marker == tmp_path / "step_7" / "DONE"
    assert saved.marker.read_bytes() == b""


def test_no_marker(tmp_path):
    save_checkpoint(shuffled(qwen3_like(), 6), tmp_path / "m", marker=None)
    assert not (tmp_path / "m" / "STABLE").exists()
    assert (tmp_path / "m" / INDEX_NAME).exists()


def _pairs(**extra):
    return list(qwen3_like(layers=1).items())[:3] + list(extra.items())


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (_pairs() + [("model.norm.weight", torch.ones(2))], "tensor 'model.norm.weight' is given twice"),
        (_pairs() + [("../../etc/passwd", torch.ones(2))], "tensor name '../../etc/passwd' is not a module path"),
        (_pairs() + [("a/b", torch.ones(2))], "tensor name 'a/b' is not a module path"),
        (_pairs() + [("__metadata__", torch.ones(2))], "tensor name '__metadata__' is not a module path"),
        (_pairs() + [("", torch.ones(2))], "tensor name '' is not a non-empty string"),
        (_pairs() + [("x.weight", [1.0, 2.0])], "tensor 'x.weight' is a list, not a torch.Tensor"),
        (_pairs() + [("x.weight", torch.ones(2, device="meta"))], "is on the meta device"),
        (_pairs() + [("x.weight", torch.tensor([1.0, float("nan"), float("inf")]))],
         "tensor 'x.weight' has 1 NaN and 1 Inf values; refusing to write it (pass allow_nonfinite=True"),
        (_pairs() + ["x.weight"], "expected (name, tensor) pairs, got a str"),
        ([], "no tensors to write"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, pairs, message):
    with pytest.raises(LayerwiseError) as info:
        save_checkpoint(iter(pairs), tmp_path / "out")
    text = str(info.value)
    assert message in text
    assert text.startswith(f"{tmp_path / 'out'}: ") and "\n" not in text
    assert list(tmp_path.iterdir()) == []  # no temporary directory, no destination


def test_nonfinite_written_when_allowed(tmp_path):
    bad = torch.tensor([1.0, float("nan")])
    save_checkpoint(iter([("x.weight", bad)]), tmp_path / "n", allow_nonfinite=True)
    assert torch.isnan(loaded(tmp_path / "n")["x.weight"][1])


def test_existing_directory(tmp_path):
    dst = tmp_path / "step_1"
    dst.mkdir()
    save_checkpoint(iter(_pairs()), dst)  # an empty directory is taken
    before = sorted(p.name for p in dst.iterdir())
    with pytest.raises(LayerwiseError, match=r"exists and is not empty; pass overwrite=True to replace it$"):
        save_checkpoint(iter(_pairs()), dst)
    assert sorted(p.name for p in dst.iterdir()) == before
    (dst / "old-only.txt").write_text("x")
    saved = save_checkpoint(iter(list(qwen3_like(layers=1).items())), dst, overwrite=True, config=CONFIG)
    assert saved.replaced
    assert not (dst / "old-only.txt").exists() and (dst / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    (dst / "sub").mkdir()
    with pytest.raises(LayerwiseError, match="overwrite replaces only a directory of plain files"):
        save_checkpoint(iter(_pairs()), dst, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LayerwiseError, match="exists and is not a directory"):
        save_checkpoint(iter(_pairs()), tmp_path / "file")


@pytest.mark.parametrize("marker", ["a/b", "..", "", "config.json", INDEX_NAME, "x.safetensors"])
def test_bad_marker(tmp_path, marker):
    with pytest.raises(LayerwiseError, match="must be a plain file name"):
        save_checkpoint(iter(_pairs()), tmp_path / "out", marker=marker)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(LayerwiseError, match="max_shard_size must be positive, not 0"):
        save_checkpoint(iter(_pairs()), tmp_path / "out", max_shard_size=0)
    with pytest.raises(LayerwiseError, match="config must be a dict or have to_dict"):
        save_checkpoint(iter(_pairs()), tmp_path / "out", config="qwen3")


@pytest.mark.parametrize("exc", [RuntimeError("trainer crashed"), KeyboardInterrupt()])
def test_a_failing_producer_leaves_nothing(tmp_path, exc):
    def producer():
        yield from qwen3_like(layers=1).items()
        raise exc

    with pytest.raises(type(exc)):
        save_checkpoint(producer(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_strided_and_odd_dtypes(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    pairs = [("t.weight", base.t()), ("i.weight", torch.arange(5, dtype=torch.int64)),
             ("b.weight", torch.tensor([True, False])), ("s.weight", torch.tensor(3.5)),
             ("e.weight", torch.zeros(0, 4, dtype=torch.float16))]
    save_checkpoint(iter(pairs), tmp_path / "o")
    got = loaded(tmp_path / "o")
    for name, tensor in pairs:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name], tensor.contiguous()), name


@pytest.mark.gpu
def test_cuda_tensors(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    sd = qwen3_like()
    big = torch.randn(3000, 1000, dtype=torch.float32)  # 12 MB: several 8 MiB device-to-host pieces
    on_gpu = [(n, t.cuda()) for n, t in sd.items()] + [("model.extra.weight", big.cuda())]
    save_checkpoint(iter(on_gpu), tmp_path / "g", config=CONFIG, max_shard_size=6000)
    got = loaded(tmp_path / "g")
    for name, tensor in [*sd.items(), ("model.extra.weight", big)]:
        assert torch.equal(got[name], tensor), name


@pytest.mark.gpu
def test_a_cuda_state_dict_writes_the_cpu_files_byte_for_byte(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    g = torch.Generator().manual_seed(5)
    sd = qwen3_like()
    # Beyond the small ones: a bf16 tensor of several 8 MiB device-to-host pieces with an odd remainder, a
    # non-contiguous one (made contiguous on the device first), integers, booleans, a scalar and an empty one.
    sd["model.extra.big.weight"] = torch.randn(3001, 2047, generator=g).to(torch.bfloat16)
    sd["model.extra.transposed.weight"] = torch.randn(1024, 768, generator=g).to(torch.bfloat16).t()
    sd["model.extra.ids"] = torch.arange(1000, dtype=torch.int64)
    sd["model.extra.mask"] = torch.rand(77, generator=g) > 0.5
    sd["model.extra.scale"] = torch.tensor(0.125)
    sd["model.extra.empty"] = torch.zeros(0, 8, dtype=torch.float16)
    save_checkpoint(shuffled(sd, 1), tmp_path / "cpu", config=CONFIG, max_shard_size=2 * 10**6)

    device = torch.device("cuda")
    on_gpu = {name: (t.t().contiguous().to(device).t() if name.endswith("transposed.weight") else t.to(device))
              for name, t in sd.items()}
    assert not on_gpu["model.extra.transposed.weight"].is_contiguous()
    copies = {name: t.clone() for name, t in on_gpu.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    saved = save_checkpoint(shuffled(on_gpu, 2), tmp_path / "gpu", config=CONFIG, max_shard_size=2 * 10**6)

    # The same files, byte for byte: layout, headers (digests included), data and index.
    cpu_files = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert sorted(p.name for p in (tmp_path / "gpu").iterdir()) == cpu_files and len(saved.shards) > 2
    for name in cpu_files:
        assert (tmp_path / "gpu" / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes(), name
    got = loaded(tmp_path / "gpu")
    for name, tensor in sd.items():
        assert torch.equal(got[name], tensor.contiguous()), name
    # The caller's tensors are untouched, still on the device; the device held at most one extra tensor
    # (the contiguous copy of the transposed one), plus the allocator's rounding.
    for name, tensor in on_gpu.items():
        assert tensor.device.type == "cuda" and torch.equal(tensor, copies[name]), name
    transposed = sd["model.extra.transposed.weight"]
    assert torch.cuda.max_memory_allocated(device) - before <= transposed.numel() * 2 + (2 << 20)
