"""Sparse delta checkpoints: the format, its validation, and the two producers (save_checkpoint(base=), write_delta)."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from benchmarks.bench_rl_steps import measure
from layerwise_cli import save_checkpoint
from layerwise_cli.checkpoint.delta.encode import encode_patch
from layerwise_cli.checkpoint.delta.format import (
    BITMAP,
    DELTA_FILE,
    INDEX,
    WHOLE,
)
from layerwise_cli.checkpoint.delta.read import delta_file, read_delta
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_bytes
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.digests import checkpoint_digests, tensor_digest
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.checkpoint.steps.local import list_steps, steps_to_delete
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.writer.delta_file import ShardBytes
from layerwise_cli.writer.delta_step import write_delta
from tests.support.deltas import changed_copy, small_state_dict, stored_bytes

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def raw(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def rebuilt(delta_dir: Path, base_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the step, from the base's bytes and the delta (as a reload rebuilds them)."""
    delta = read_delta(delta_dir)
    return {name: np.asarray(delta.apply(name, data)) for name, data in stored_bytes(base_dir).items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(sorted(DTYPES)), fraction=st.sampled_from([0.0, 0.005, 0.03, 0.1, 0.4, 0.9]),
       seed=st.integers(0, 2**16), rows=st.integers(1, 40), cols=st.integers(1, 70))
def test_base_plus_delta_is_the_new_step_bit_for_bit(dtype, fraction, seed, rows, cols):
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    base = {"a.weight": torch.randn(rows, cols, generator=gen).to(torch_dtype),
            "b.weight": torch.randn(cols, generator=gen).to(torch_dtype),
            "c.weight": (torch.randn(rows * cols + 5, generator=gen) * 1e3).to(torch_dtype)}
    new = {name: changed_copy(t, fraction, seed + i) for i, (name, t) in enumerate(base.items())}
    new["b.weight"] = base["b.weight"].clone()  # one tensor unchanged
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_checkpoint(base.items(), root / "step_1")
        saved = save_checkpoint(new.items(), root / "step_2", base=root / "step_1", marker=None)
        if saved.delta is None:
            # Full step written instead: only when a delta would not be smaller.
            assert "not be smaller" in saved.fallback
            got = stored_bytes(root / "step_2")
        else:
            got = rebuilt(root / "step_2", root / "step_1")
            delta = read_delta(root / "step_2")
            assert set(delta.patches) <= {"a.weight", "c.weight"}
            for name, t in new.items():
                assert delta.step_digests[name] == tensor_digest(dtype, tuple(t.shape), raw(t))
                assert delta.base_digests[name] == tensor_digest(dtype, tuple(t.shape), raw(base[name]))
        for name, t in new.items():
            assert np.array_equal(got[name], raw(t)), name


def test_each_tensor_takes_the_smallest_layout():
    base = torch.randn(4096).to(torch.bfloat16)
    kinds: dict[int, dict[float, str]] = {1: {}, 2: {}}
    for version, fraction in ((v, f) for v in (1, 2) for f in (0.01, 0.1, 0.8)):
        new = changed_copy(base, fraction, 1)
        encoded = encode_patch("w", "BF16", (4096,), raw(base), raw(new), version=version)
        kinds[version][fraction] = encoded.patch.kind
        changed = int((raw(new).view(np.uint16) != raw(base).view(np.uint16)).sum())
        assert encoded.patch.changed == (4096 if encoded.patch.kind == WHOLE else changed)
    assert kinds == {1: {0.01: INDEX, 0.1: BITMAP, 0.8: WHOLE}, 2: {0.01: SPARSE, 0.1: SPARSE, 0.8: WHOLE}}
    assert encode_patch("w", "BF16", (4096,), raw(base), raw(base.clone())) is None


def test_a_sign_flip_of_zero_is_a_change():
    base = torch.zeros(100, dtype=torch.float32)
    new = base.clone()
    new[3] = -0.0
    encoded = encode_patch("w", "F32", (100,), raw(base), raw(new))
    assert encoded is not None and encoded.patch.changed == 1


@pytest.fixture
def steps(tmp_path):
    """A base step and a delta against it (1% of each tensor changed: index positions)."""
    base = small_state_dict(torch.bfloat16)
    new = {name: changed_copy(t, 0.01 if t.numel() > 100 else 0.2, 7) for name, t in base.items()}
    save_checkpoint(base.items(), tmp_path / "step_1")
    saved = save_checkpoint(new.items(), tmp_path / "step_2", base=tmp_path / "step_1")
    assert saved.delta is not None, saved.fallback
    return tmp_path / "step_1", tmp_path / "step_2", new


@pytest.fixture
def v1_steps(steps, tmp_path):
    """The same steps, the delta written in format v1 (index positions): what an older layerwise wrote."""
    base_dir, _, new = steps
    save_checkpoint(new.items(), tmp_path / "full_2")
    saved = write_delta(base_dir, tmp_path / "full_2", tmp_path / "v1_2", delta_format=1)
    assert saved.delta is not None and read_delta(tmp_path / "v1_2").version == 1
    return base_dir, tmp_path / "v1_2", new


def test_save_with_a_base_writes_a_small_delta_with_both_steps_digests(steps):
    base_dir, delta_dir, new = steps
    assert sorted(p.name for p in delta_dir.iterdir()) == ["STABLE", DELTA_FILE]
    assert delta_file(delta_dir) == delta_dir / DELTA_FILE
    assert delta_file(base_dir) is None
    delta = read_delta(delta_dir)
    assert delta.base_location == str(base_dir.absolute())
    assert delta.base_digests == checkpoint_digests(open_checkpoint(str(base_dir)).shards)
    assert set(delta.step_digests) == set(new)
    full = sum(t.numel() * t.element_size() for t in new.values())
    assert (delta_dir / DELTA_FILE).stat().st_size < 0.5 * full
    delta.validate()


def test_save_falls_back_to_a_full_step_when_the_base_cannot_serve(tmp_path):
    base = small_state_dict(torch.bfloat16)
    save_checkpoint(base.items(), tmp_path / "step_1")
    reshaped = {**base, "model.layers.0.input_layernorm.weight": torch.ones(33, dtype=torch.bfloat16)}
    cases = {
        "missing": (base, tmp_path / "nowhere", "does not exist"),
        "reshaped": (reshaped, tmp_path / "step_1", "the base's"),
        "all changed": ({n: t + 1 for n, t in base.items()}, tmp_path / "step_1", "not be smaller"),
    }
    for i, (tensors, against, why) in enumerate(cases.values()):
        saved = save_checkpoint(tensors.items(), tmp_path / f"out_{i}", base=against)
        assert saved.delta is None and why in saved.fallback
        assert not (tmp_path / f"out_{i}" / DELTA_FILE).exists()
        assert checkpoint_digests(open_checkpoint(str(tmp_path / f"out_{i}")).shards) is not None


def test_a_base_whose_header_digest_lies_is_not_proved(tmp_path):
    base = small_state_dict(torch.float32)
    save_checkpoint(base.items(), tmp_path / "step_1")
    shard = next((tmp_path / "step_1").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last tensor's bytes change, its header digest does not
    shard.write_bytes(bytes(data))
    saved = save_checkpoint(small_state_dict(torch.float32).items(), tmp_path / "step_2", base=tmp_path / "step_1")
    assert saved.delta is None and "cannot be proved" in saved.fallback


def test_a_delta_against_a_base_another_tool_wrote_out_of_layer_order_is_written(tmp_path):
    # The base's shards are another writer's (safetensors, last layer first): their order is theirs to answer for,
    # and a delta rebuilds that layout; only shards save_checkpoint writes itself are held to layer order.
    from safetensors.torch import save_file  # noqa: PLC0415 - only this test writes shards by hand

    base = small_state_dict(torch.bfloat16)
    names = sorted(base, reverse=True)  # layers.1, layers.0, embed: later layers first
    (tmp_path / "base").mkdir()
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({name: base[name] for name in part}, str(tmp_path / "base" / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (tmp_path / "base" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    new = {name: changed_copy(t, 0.01 if t.numel() > 100 else 0.2, 3) for name, t in base.items()}
    saved = save_checkpoint(new.items(), tmp_path / "step_1", base=tmp_path / "base")
    assert saved.delta is not None, saved.fallback
    got = rebuilt(tmp_path / "step_1", tmp_path / "base")
    assert all(np.array_equal(got[name], raw(t)) for name, t in new.items())


def test_a_chain_at_max_chain_links_starts_again_with_a_full_step(tmp_path):
    tensors = small_state_dict(torch.bfloat16)
    save_checkpoint(tensors.items(), tmp_path / "step_0")
    kinds = []
    for i in range(1, 5):
        tensors = {name: changed_copy(t, 0.01 if t.numel() > 100 else 0.2, i) for name, t in tensors.items()}
        saved = save_checkpoint(tensors.items(), tmp_path / f"step_{i}", base=tmp_path / f"step_{i - 1}",
                                max_chain=2)
        kinds.append("delta" if saved.delta is not None else saved.fallback)
    assert kinds[:2] == ["delta", "delta"] and kinds[3] == "delta"
    assert "chain of 2 deltas" in kinds[2] and "max_chain 2" in kinds[2]
    assert delta_file(tmp_path / "step_3") is None  # the new chain's full step
    assert len(open_step(str(tmp_path / "step_4")).delta.links) == 1


def test_a_delta_against_a_delta_rebuilds_through_the_chain(steps, tmp_path):
    base_dir, delta_dir, new = steps
    third = {name: changed_copy(t, 0.02, 11) for name, t in new.items()}
    saved = save_checkpoint(third.items(), tmp_path / "step_3", base=delta_dir)
    assert saved.delta is not None and saved.delta.base == str(delta_dir.absolute())
    step = open_step(str(tmp_path / "step_3"))
    assert [link.path.parent for link in step.delta.links] == [delta_dir, tmp_path / "step_3"]
    assert step.local_dir == base_dir  # read from the full step at the chain's start
    reader = ShardBytes(step)
    for entry in step.tensors:
        assert np.array_equal(np.asarray(reader.of(entry)), raw(third[entry.name])), entry.name
    # From full checkpoints, against the delta: the same delta file.
    save_checkpoint(third.items(), tmp_path / "full_3")
    again = write_delta(delta_dir, tmp_path / "full_3", tmp_path / "cli_3")
    assert (tmp_path / "cli_3" / DELTA_FILE).read_bytes() == (tmp_path / "step_3" / DELTA_FILE).read_bytes()
    assert again.delta is not None


def test_a_rebuilt_tensor_is_proved_by_the_step_s_digest_and_a_failure_says_what_is_wrong(steps, tmp_path):
    """`rebuilt_bytes` hashes the result once; on a mismatch it names the base, or the link whose patch is corrupt."""
    base_dir, delta_dir, new = steps
    third = {name: changed_copy(t, 0.02, 11) for name, t in new.items()}
    third["model.layers.1.mlp.down_proj.weight"] = new["model.layers.1.mlp.down_proj.weight"]
    save_checkpoint(third.items(), tmp_path / "step_3", base=delta_dir)
    step = open_step(str(tmp_path / "step_3"))
    first, last = step.delta.links
    base = stored_bytes(base_dir)
    name = next(n for n in first.patches if n in last.patches)  # changed by both links
    entry = next(e for e in step.tensors if e.name == name)
    assert np.array_equal(rebuilt_bytes(step.delta, entry, base[name], "base.safetensors"), raw(third[name]))
    kept = "model.layers.1.mlp.down_proj.weight"  # changed by the first link only
    assert kept in first.patches and kept not in last.patches
    other = next(e for e in step.tensors if e.name == kept)
    assert np.array_equal(rebuilt_bytes(step.delta, other, base[kept], "x"), raw(new[kept]))

    changed_base = base[name].copy()
    changed_base[-1] ^= 1
    with pytest.raises(LayerwiseError, match="its bytes are not the delta's base") as info:
        rebuilt_bytes(step.delta, entry, changed_base, "base.safetensors")
    assert info.value.where == "base.safetensors"

    def flip_first_value(header, data):
        key = next(k for k in header if k.startswith(name + "::") and not k.endswith("::positions"))
        data[header[key]["data_offsets"][0]] ^= 0x01

    corrupt(tmp_path / "step_3", flip_first_value)
    step = open_step(str(tmp_path / "step_3"))
    # A v2 chunk's checksum fails as it is decoded (a v1 value would fail the step's digest): either way the
    # link is named.
    with pytest.raises(LayerwiseError, match=r"\(corrupt delta\)") as info:
        rebuilt_bytes(step.delta, entry, base[name], "base.safetensors")
    assert info.value.where == str(step.delta.links[-1].path)  # the second link, the one corrupted


def test_a_chain_that_loops_is_refused(steps, tmp_path):
    _, delta_dir, new = steps
    save_checkpoint({n: changed_copy(t, 0.02, 11) for n, t in new.items()}.items(), tmp_path / "step_3",
                    base=delta_dir)

    def point_at_step_3(header, data):
        meta = json.loads(header["__metadata__"]["layerwise.delta"])
        meta["base"]["location"] = str(tmp_path / "step_3")
        header["__metadata__"]["layerwise.delta"] = json.dumps(meta)

    corrupt(delta_dir, point_at_step_3)
    with pytest.raises(LayerwiseError, match="a loop"):
        open_step(str(tmp_path / "step_3"))


def corrupt(delta_dir: Path, edit) -> Path:
    """Apply EDIT(header dict, data bytearray) to the delta file and write it back."""
    path = delta_dir / DELTA_FILE
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = bytearray(blob[8 + n:])
    edit(header, data)
    raw_header = json.dumps(header).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + bytes(data))
    return path


def index_entry(header: dict) -> tuple[str, dict]:
    meta = json.loads(header["__metadata__"]["layerwise.delta"])
    name = next(n for n, spec in meta["tensors"].items() if spec["kind"] == INDEX)
    return name, header[name + "::positions"]


def test_a_position_out_of_range_is_refused_naming_file_and_tensor(v1_steps):
    _, delta_dir, _ = v1_steps

    def out_of_range(header, data):
        _, entry = index_entry(header)
        end = entry["data_offsets"][1]
        data[end - 4:end] = struct.pack("<i", 10**9)

    path = corrupt(delta_dir, out_of_range)
    delta = read_delta(delta_dir)
    name, _ = index_entry(json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]]))
    with pytest.raises(LayerwiseError) as err:
        delta.validate()
    message = str(err.value)
    assert str(path) in message and name in message and "1000000000 is out of range" in message
    assert "\n" not in message


def test_positions_out_of_order_are_refused(v1_steps):
    _, delta_dir, _ = v1_steps

    def swap(header, data):
        _, entry = index_entry(header)
        begin = entry["data_offsets"][0]
        data[begin:begin + 8] = data[begin + 4:begin + 8] + data[begin:begin + 4]

    corrupt(delta_dir, swap)
    with pytest.raises(LayerwiseError, match="not strictly increasing"):
        read_delta(delta_dir).validate()


@pytest.fixture
def bitmap_step(tmp_path):
    """A delta whose one patch is a bitmap over 4099 elements (3 padding bits in its last byte), its base tensor
    and its new one."""
    base = {"w.weight": torch.randn(4099, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    save_checkpoint(base.items(), tmp_path / "step_1")
    new = {"w.weight": changed_copy(base["w.weight"], 0.1, 5)}
    save_checkpoint(new.items(), tmp_path / "full_2")
    saved = write_delta(tmp_path / "step_1", tmp_path / "full_2", tmp_path / "step_2", marker=None, delta_format=1)
    assert saved.delta is not None and read_delta(tmp_path / "step_2").patches["w.weight"].kind == BITMAP
    return tmp_path / "step_2", base["w.weight"], new["w.weight"]


def test_a_bitmap_s_positions_are_its_set_bits(bitmap_step):
    delta_dir, base, new = bitmap_step
    delta = read_delta(delta_dir)
    delta.validate()
    expected = np.flatnonzero(raw(base).view(np.uint16) != raw(new).view(np.uint16))
    assert np.array_equal(delta.positions("w.weight"), expected) and expected.size == delta.patches["w.weight"].changed


@pytest.mark.parametrize(("bit", "what"), [(7, "bitmap sets bits past its 4099 elements"),
                                           (None, "positions for")])
def test_a_bitmap_with_a_bit_too_many_is_refused(bitmap_step, bit, what):
    """A padding bit set, or one more position than values: refused when validated, before anything is applied."""
    delta_dir, _, _ = bitmap_step

    def set_bit(header, data):
        begin, end = header["w.weight::positions"]["data_offsets"]
        if bit is not None:
            data[end - 1] |= 1 << bit
        else:  # the first unset bit of the bitmap, set
            at = next(i for i in range(begin, end) if data[i] != 0xFF)
            data[at] |= next(1 << b for b in range(8) if not data[at] & (1 << b))

    path = corrupt(delta_dir, set_bit)
    with pytest.raises(LayerwiseError) as err:
        read_delta(delta_dir).validate()
    message = str(err.value)
    assert what in message and "w.weight" in message and str(path) in message and "corrupt delta" in message


def test_a_truncated_delta_is_refused_naming_the_file(steps):
    _, delta_dir, _ = steps
    path = delta_dir / DELTA_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LayerwiseError) as err:
        read_delta(delta_dir)
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_metadata_that_does_not_match_the_entries_is_refused(v1_steps):
    _, delta_dir, _ = v1_steps

    def drop_values(header, data):
        name, _ = index_entry(header)
        entry = header.pop(name + "::values")
        begin, end = entry["data_offsets"]
        # keep the data section tiled: the bytes go, and every later entry moves down
        del data[begin:end]
        for key, value in header.items():
            if key != "__metadata__" and value["data_offsets"][0] >= end:
                value["data_offsets"] = [o - (end - begin) for o in value["data_offsets"]]

    corrupt(delta_dir, drop_values)
    with pytest.raises(LayerwiseError, match=r"::values is missing"):
        read_delta(delta_dir)


def test_write_delta_from_two_full_steps_equals_save_with_a_base(tmp_path, steps):
    base_dir, delta_dir, new = steps
    save_checkpoint(new.items(), tmp_path / "full_2")
    result = write_delta(base_dir, tmp_path / "full_2", tmp_path / "cli_2")
    assert result.delta is not None
    assert (tmp_path / "cli_2" / DELTA_FILE).read_bytes() == (delta_dir / DELTA_FILE).read_bytes()
    for name, data in rebuilt(tmp_path / "cli_2", base_dir).items():
        assert np.array_equal(data, raw(new[name]))


def test_delta_command(tmp_path, steps):
    base_dir, _, new = steps
    save_checkpoint(new.items(), tmp_path / "full_2", config={"architectures": ["Qwen3ForCausalLM"]})
    runner = CliRunner()
    result = runner.invoke(app, ["delta", str(base_dir), str(tmp_path / "full_2"), str(tmp_path / "d"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "delta" and data["bytes"] < data["full_bytes"] and data["patched_tensors"] == 4
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["STABLE", "config.json", DELTA_FILE]
    again = runner.invoke(app, ["delta", str(base_dir), str(tmp_path / "full_2"), str(tmp_path / "d")])
    assert again.exit_code == 1 and "exists and is not empty" in again.stderr
    shown = runner.invoke(app, ["delta", str(base_dir), str(tmp_path / "full_2"), str(tmp_path / "d"), "--force"])
    assert shown.exit_code == 0 and "changed" in shown.stdout
    full = runner.invoke(app, ["delta", str(tmp_path / "nowhere"), str(tmp_path / "full_2"), str(tmp_path / "f"),
                               "--json"])
    data = json.loads(full.stdout)
    assert data["kind"] == "full" and "does not exist" in data["fallback"]
    assert (tmp_path / "f" / "model.safetensors.index.json").exists()


def test_inspect_order_describes_a_delta(steps, tmp_path):
    base_dir, delta_dir, new = steps
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect-order", str(delta_dir), "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    view = data["delta"]
    delta = read_delta(delta_dir)
    assert view["base"] == str(base_dir.absolute()) and view["file_bytes"] == (delta_dir / DELTA_FILE).stat().st_size
    assert view["changed_values"] == delta.changed_values
    assert view["values"] == sum(t.numel() for t in new.values())
    changed = {row["name"] for row in view["layers"] if row["patched_tensors"]}
    layer_bytes = {row["name"]: row["bytes"] for row in view["layers"]}
    assert view["reload_reads"] == delta.header.nbytes + sum(layer_bytes[name] for name in changed)
    # The step is described in its base's layout, with the step's digests.
    assert data["header_digests"]["tensors"] == dict(delta.step_digests)
    assert data["total_bytes"] == sum(t.numel() * t.element_size() for t in new.values())
    table = runner.invoke(app, ["inspect-order", str(delta_dir)])
    assert table.exit_code == 0 and "a reload reads" in table.stdout
    assert "Changed values per parent layer" in table.stdout
    full = json.loads(runner.invoke(app, ["inspect-order", str(base_dir), "--json"]).stdout)
    assert full["delta"] is None


def test_inspect_order_scan_checks_a_delta_s_positions(v1_steps):
    _, delta_dir, _ = v1_steps

    def out_of_range(header, data):
        _, entry = index_entry(header)
        end = entry["data_offsets"][1]
        data[end - 4:end] = struct.pack("<i", 10**9)

    corrupt(delta_dir, out_of_range)
    runner = CliRunner()
    assert runner.invoke(app, ["inspect-order", str(delta_dir)]).exit_code == 0  # headers only
    scanned = runner.invoke(app, ["inspect-order", str(delta_dir), "--scan"])
    assert scanned.exit_code == 1 and "out of range" in scanned.stderr


def test_watch_keep_never_deletes_the_base_of_a_delta_that_stays(tmp_path):
    base = small_state_dict(torch.bfloat16)
    run = tmp_path / "run"
    save_checkpoint(base.items(), run / "step_1")
    save_checkpoint(base.items(), run / "step_2")
    previous = base
    for number in (3, 4, 5):  # step_3 against step_2, step_4 against step_3 (a chain), step_5 in full
        step = {n: changed_copy(t, 0.01, number) for n, t in previous.items()}
        saved = save_checkpoint(step.items(), run / f"step_{number}", base=run / f"step_{number - 1}"
                                if number < 5 else None)
        assert (saved.delta is not None) == (number < 5)
        previous = step
    steps = list_steps(run)
    held = steps[-1]
    # Keeping the newest 2 (step_4, step_5): step_4 needs step_3, which needs step_2; step_1 alone goes.
    assert [s.name for s in steps_to_delete(steps, 2, held, set())] == ["step_1"]
    assert [s.name for s in steps_to_delete(steps, 1, held, set())] == ["step_1", "step_2", "step_3", "step_4"]


def test_the_rl_step_benchmark_measures_more_change_at_higher_learning_rates():
    rows = [measure(lr, 1 << 16, warmup=5) for lr in (1e-6, 1e-5, 1e-3)]
    fractions = [row["changed_fraction"] for row in rows]
    assert 0 < fractions[0] < fractions[1] < fractions[2]
    assert rows[0]["delta_over_full"] < rows[1]["delta_over_full"] <= 1.0
    assert rows[2]["layout"] == "whole"  # at 1e-3 nearly every value moves


def _nan_chain(root: Path, repaired: bool) -> Path:
    """step_0 full; step_1 a delta holding a NaN at element 3 of one tensor; step_2 a delta against step_1 that
    rewrites that element (REPAIRED) or leaves it NaN (so not in its patch)."""
    gen = torch.Generator().manual_seed(5)
    step = {"model.layers.0.mlp.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    save_checkpoint(step.items(), root / "step_0")
    nan = {k: v.clone() for k, v in step.items()}
    nan["model.norm.weight"][3] = float("nan")
    save_checkpoint(nan.items(), root / "full_1", allow_nonfinite=True)
    # Format v1: its links store new values, which the chain checks before anything loads (a v2 link stores
    # differences, checked as the rebuilt values are handed over or written).
    write_delta(root / "step_0", root / "full_1", root / "step_1", marker=None, delta_format=1)
    after = {k: changed_copy(v, 0.02, seed=7) for k, v in nan.items()}
    after["model.norm.weight"][5] = 2.0
    after["model.norm.weight"][3] = 1.5 if repaired else float("nan")
    save_checkpoint(after.items(), root / "full_2", allow_nonfinite=not repaired)
    saved = write_delta(root / "step_1", root / "full_2", root / "step_2", marker=None, delta_format=1)
    assert saved.delta is not None
    return root / "step_2"


def test_a_step_that_rewrites_an_earlier_steps_nan_loads_through_its_chain(tmp_path):
    # An RL run that wrote a NaN step goes on against it: the next step rebuilds finite, and must load.
    opened = open_step(str(_nan_chain(tmp_path, repaired=True)))
    opened.delta.refuse_nonfinite()
    with pytest.raises(LayerwiseError, match=r"step_1.*model.norm.weight.*1 NaN"):
        open_step(str(tmp_path / "step_1")).delta.refuse_nonfinite()


@pytest.mark.parametrize("repaired", [True, False])
def test_a_v2_chain_through_a_nan_step_with_sparse_patches_is_checked_by_what_it_rebuilds(tmp_path, repaired):
    """The RL loop's NaN step written as v2 against the step before: the NaN tensor changed whole (every value,
    as AdamW changes a norm), the others sparse (differences, no stored values). The next step, written
    against it, rewrites the norm: the chain loads; when it leaves the NaN, it is refused, naming the NaN step."""
    gen = torch.Generator().manual_seed(5)
    step = {"model.layers.0.mlp.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    save_checkpoint(step.items(), tmp_path / "step_0")
    nan = {"model.layers.0.mlp.weight": changed_copy(step["model.layers.0.mlp.weight"], 0.02, seed=3),
           "model.norm.weight": torch.full((64,), 1.25, dtype=torch.bfloat16)}
    nan["model.norm.weight"][3] = float("nan")
    save_checkpoint(nan.items(), tmp_path / "step_1", base=tmp_path / "step_0", allow_nonfinite=True)
    after = {"model.layers.0.mlp.weight": changed_copy(nan["model.layers.0.mlp.weight"], 0.02, seed=4),
             "model.norm.weight": torch.full((64,), 1.5, dtype=torch.bfloat16)}
    if not repaired:
        after["model.norm.weight"][3] = float("nan")
    save_checkpoint(after.items(), tmp_path / "step_2", base=tmp_path / "step_1", allow_nonfinite=not repaired)
    chain = open_step(str(tmp_path / "step_2")).delta
    kinds = [{name: patch.kind for name, patch in link.patches.items()} for link in chain.links]
    assert kinds[0] == {"model.layers.0.mlp.weight": "sparse", "model.norm.weight": "whole"}, kinds
    if repaired:
        chain.refuse_nonfinite()
    else:
        with pytest.raises(LayerwiseError, match=r"model.norm.weight.*1 NaN"):
            chain.refuse_nonfinite()


def test_a_nan_an_earlier_link_leaves_in_the_step_is_refused(tmp_path):
    step_2 = _nan_chain(tmp_path, repaired=False)
    # The NaN stays where step_1 put it: step_2's patch does not hold it, and the rebuilt step would.
    with pytest.raises(LayerwiseError, match=r"step_1.*model.norm.weight.*1 NaN.*no later step of its chain"):
        open_step(str(step_2)).delta.refuse_nonfinite()
