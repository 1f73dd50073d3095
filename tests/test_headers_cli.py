"""Bad input: every broken file or layout gives one `Error: <file>: <what>` line and exit 1."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from typer.testing import CliRunner

from layerwise_cli.checkpoint.format.header import DTYPE_BITS, parse_header, read_shard_header
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

runner = CliRunner()


def _shard(path: Path, header: object, data: int | bytes = 0, *, length: int | None = None) -> Path:
    """Write a file: 8-byte length (default: the header's), header JSON (or raw bytes), data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = data if isinstance(data, bytes) else bytes(data)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)
    return path


def _u8(begin: int, end: int, shape: list[int] | None = None, dtype: str = "U8") -> dict:
    return {"dtype": dtype, "shape": [end - begin] if shape is None else shape, "data_offsets": [begin, end]}


def invoke_error(*args: str, env: dict[str, str] | None = None) -> str:
    """Run the CLI, expect exit 1 and exactly one `Error:` line on stderr; return that line."""
    result = runner.invoke(app, ["inspect-order", *args], env=env)
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    assert result.stdout == ""
    return lines[0]


# Each case builds the bad input under tmp_path and returns (SOURCE, file named in the error).
Case = Callable[[Path], tuple[Path, Path]]


def truncated_file(tmp: Path) -> tuple[Path, Path]:
    path = tmp / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    return path, path


def header_length_beyond_file(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {}, length=10_000)), p


def header_not_json(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", b'{"a": {"dtype": ')), p


def header_not_utf8(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", b'{"\xff\xfe": 1}')), p


def header_not_object(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", [1, 2, 3])), p


def offsets_out_of_bounds(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 16)}, 8)), p


def overlapping_offsets(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 8), "b": _u8(4, 12)}, 12)), p


def gap_between_tensors(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 4), "b": _u8(8, 12)}, 12)), p


def bytes_after_last_tensor(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 4)}, 9)), p


def unknown_dtype(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 4, dtype="Q8")}, 4)), p


def shape_offset_mismatch(tmp: Path) -> tuple[Path, Path]:
    # F32 [4] needs 16 bytes; the offsets span 8.
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 8, shape=[4], dtype="F32")}, 8)), p


def negative_shape(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 4, shape=[-4])}, 4)), p


def sub_byte_tensor_off_boundary(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"a": _u8(0, 2, shape=[3], dtype="F4")}, 2)), p


def bad_metadata(tmp: Path) -> tuple[Path, Path]:
    return (p := _shard(tmp / "model.safetensors", {"__metadata__": {"format": 1}})), p


def _sharded(tmp: Path) -> Path:
    folder = tmp / "ckpt"
    write_checkpoint(folder, SyntheticModel(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=8,
                                            vocab=16), "in_order", 3)
    return folder


def index_names_missing_shard(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    (folder / "model-00002-of-00003.safetensors").unlink()
    return folder, folder / "model.safetensors.index.json"


def index_names_tensor_the_shard_lacks(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.7.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    return folder, index_path


def index_not_json(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    (folder / "model.safetensors.index.json").write_text("{")
    return folder, folder / "model.safetensors.index.json"


def index_without_weight_map(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return folder, folder / "model.safetensors.index.json"


def bad_shard_in_directory(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    shard = folder / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])  # one byte short: the last tensor runs past the end
    return folder, shard


def config_not_json(tmp: Path) -> tuple[Path, Path]:
    folder = _sharded(tmp)
    (folder / "config.json").write_text("not json")
    return folder, folder / "config.json"


def empty_directory(tmp: Path) -> tuple[Path, Path]:
    (folder := tmp / "empty").mkdir()
    return folder, folder


def nonexistent_path(tmp: Path) -> tuple[Path, Path]:
    return tmp / "no" / "such" / "model", tmp / "no" / "such" / "model"


CASES: dict[Case, str] = {
    truncated_file: "truncated: 3 bytes, shorter than the 8-byte header length",
    header_length_beyond_file: "header length 10000 runs past the end of the file",
    header_not_json: "header is not valid JSON",
    header_not_utf8: "header is not valid UTF-8",
    header_not_object: "header is a JSON list, not an object",
    offsets_out_of_bounds: "tensor 'a' ends at byte 16 of the data section, but the file holds 8",
    overlapping_offsets: "tensors 'a' and 'b' overlap",
    gap_between_tensors: "4 unused bytes after 'a'",
    bytes_after_last_tensor: "5 bytes after the last tensor",
    unknown_dtype: "tensor 'a': unknown dtype 'Q8'",
    shape_offset_mismatch: "tensor 'a': F32[4] needs 16 bytes but its offsets span 8",
    negative_shape: "shape [-4] is not a list of non-negative integers",
    sub_byte_tensor_off_boundary: "does not end on a byte boundary",
    bad_metadata: "__metadata__ must map strings to strings",
    index_names_missing_shard: "index names shard 'model-00002-of-00003.safetensors', which does not exist",
    index_names_tensor_the_shard_lacks: "index says 'model.layers.7.mlp.up_proj.weight' is in "
                                        "'model-00001-of-00003.safetensors', but that shard has no such tensor",
    index_not_json: "not valid JSON",
    index_without_weight_map: "index has no weight_map",
    bad_shard_in_directory: "ends at byte",
    config_not_json: "not valid JSON",
    empty_directory: "no .safetensors files in the directory",
    nonexistent_path: "no such file or directory",
}


@pytest.mark.parametrize("case", list(CASES), ids=[case.__name__ for case in CASES])
def test_bad_input_gives_one_line(tmp_path: Path, case: Case) -> None:
    source, named = case(tmp_path)
    line = invoke_error(str(source))
    assert line.startswith(f"Error: {named}: "), line
    assert CASES[case] in line


def test_traceback_only_with_debug(tmp_path: Path) -> None:
    source, _ = overlapping_offsets(tmp_path)
    result = runner.invoke(app, ["inspect-order", str(source)], env={"LAYERWISE_DEBUG": "1"})
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and result.stderr.rstrip().splitlines()[-1].startswith("Error: ")


def test_valid_files_pass(tmp_path: Path) -> None:
    # The same writers the cases above bend: their output must be accepted, or the cases prove nothing.
    path = tmp_path / "model.safetensors"
    write_safetensors(path, [("b", "F32", (2, 2)), ("a", "BF16", (3,)), ("c", "C64", (1,))])
    shard, read = read_shard_header(path)
    assert [t.name for t in shard.tensors] == ["b", "a", "c"]
    assert read == 8 + shard.header_len < path.stat().st_size
    sub_byte = _shard(tmp_path / "f4.safetensors",
                      {"a": _u8(0, 2, shape=[4], dtype="F4"), "b": _u8(2, 2, shape=[0])}, 2)
    for file in (path, sub_byte):
        assert _safetensors_accepts(file)
        result = runner.invoke(app, ["inspect-order", str(file), "--json"])
        assert result.exit_code == 0, result.stderr


def _safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
        return True
    except SafetensorError:
        return False


@pytest.mark.parametrize("value", ["12XB", "-1", "lots"])
def test_bad_max_buffer_is_a_usage_error(tmp_path: Path, value: str) -> None:
    source = _sharded(tmp_path)
    result = runner.invoke(app, ["inspect-order", str(source), "--max-buffer", value])
    assert result.exit_code == 2
    assert "--max-buffer" in result.stderr and "Traceback" not in result.output


def test_bad_mapping_and_top_are_usage_errors(tmp_path: Path) -> None:
    source = _sharded(tmp_path)
    bad_mapping = runner.invoke(app, ["inspect-order", str(source), "--mapping", "guess"])
    assert bad_mapping.exit_code == 2 and "--mapping" in bad_mapping.stderr and "'guess'" in bad_mapping.stderr
    assert runner.invoke(app, ["inspect-order", str(source), "--top", "-1"]).exit_code == 2


def test_revision_on_a_local_path_is_refused(tmp_path: Path) -> None:
    source = _sharded(tmp_path)
    assert "--revision applies to Hub repo ids only" in invoke_error(str(source), "--revision", "main")


# Property tests: whatever the bytes, only the clean error comes out.

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8))
_json_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                                                 kids, max_size=4),
                            max_leaves=12)
_counts = st.integers(-3, 40)
_entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BITS)), st.text(max_size=6), _scalars),
        "shape": st.one_of(st.lists(_counts, max_size=3), _json_values),
        "data_offsets": st.one_of(st.lists(_counts, min_size=2, max_size=2), _json_values),
    },
)
_headers = st.dictionaries(
    st.one_of(st.text(max_size=10), st.just("__metadata__")),
    st.one_of(_entries, _json_values, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
    max_size=5,
)


def _only_clean_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except LayerwiseError as exc:
        assert str(exc) and "\n" not in " ".join(str(exc).split())
    # Anything else propagates and fails the property.


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_any_file_bytes_give_only_clean_errors(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "any.safetensors"
    path.write_bytes(data)
    _only_clean_errors(lambda: read_shard_header(path))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200), data_len=st.integers(0, 64))
def test_any_header_bytes_give_only_clean_errors(raw: bytes, data_len: int) -> None:
    _only_clean_errors(lambda: parse_header("x.safetensors", raw, file_size=8 + len(raw) + data_len))
    _only_clean_errors(lambda: parse_header("x.safetensors", raw, file_size=None))


@settings(max_examples=300, deadline=None)
@given(header=_headers, data_len=st.integers(0, 64))
def test_any_json_header_gives_only_clean_errors(header: dict, data_len: int) -> None:
    raw = json.dumps(header).encode()
    _only_clean_errors(lambda: parse_header("x.safetensors", raw, file_size=8 + len(raw) + data_len))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.one_of(_headers, _json_values), data_len=st.integers(0, 48),
       length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]))
def test_cli_on_any_header_exits_cleanly(
    tmp_path_factory: pytest.TempPathFactory, header: object, data_len: int, length_delta: int
) -> None:
    raw = json.dumps(header).encode()
    path = _shard(tmp_path_factory.getbasetemp() / "prop.safetensors", raw, data_len,
                  length=max(0, len(raw) + length_delta))
    result = runner.invoke(app, ["inspect-order", str(path), "--json"])
    assert result.exit_code in (0, 1), (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), result.stderr
    else:
        assert json.loads(result.stdout)["shards"] == 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensors=st.lists(
        st.tuples(st.sampled_from(["F32", "BF16", "U8", "F4", "F6_E2M3", "C64", "Q8"]),
                  st.lists(st.integers(0, 5), max_size=3), st.integers(-2, 2)),
        max_size=4,
    ),
    extra=st.integers(-3, 3),
)
def test_accepts_exactly_what_safetensors_accepts(
    tmp_path_factory: pytest.TempPathFactory, tensors: list[tuple[str, list[int], int]], extra: int
) -> None:
    # Near-valid headers: tensors laid end to end, then nudged (wrong sizes, a
    # shifted start, bytes missing or left over); our verdict must be the library's.
    header, offset = {}, 0
    for i, (dtype, shape, nudge) in enumerate(tensors):
        bits = DTYPE_BITS.get(dtype, 8)
        numel = 1
        for d in shape:
            numel *= d
        size = max(0, -(-numel * bits // 8) + nudge)
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    path = _shard(tmp_path_factory.getbasetemp() / "cross.safetensors", header, max(0, offset + extra))
    try:
        read_shard_header(path)
        ours = True
    except LayerwiseError:
        ours = False
    event(f"accepted={ours}")
    assert ours == _safetensors_accepts(path), header
