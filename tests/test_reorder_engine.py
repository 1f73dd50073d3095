"""`layerwise reorder`: round trips, the shard-boundary rule, safe writes, bounded memory, the real engine."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from typer.testing import CliRunner

import layerwise_cli.reorder.write as write
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, ShardHeader, TensorEntry, read_shard_header
from layerwise_cli.checkpoint.sources import Checkpoint, natural_key
from layerwise_cli.cli.app import app
from layerwise_cli.client.engine.in_process import EngineOptions
from layerwise_cli.demo import demo_checkpoint, demo_prompt, expected_answer
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import PlannedTensor, build_plan, simulate_buffering
from layerwise_cli.reorder.output_shards import split_shards
from layerwise_cli.reorder.rewrite import reorder
from tests.support.hub_server import HubServer, once_named
from tests.support.in_process import start_here, stop_here
from tests.support.synthetic import SyntheticModel, shard_groups, write_checkpoint, write_safetensors

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

# (layout, model shapes): every generator order, a >10-layer model so that
# `layers.10` < `layers.2` matters, MoE with experts spread, tied embeddings.
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "in_order": ("in_order", {"layers": 2}),
    "split_layer": ("split_layer", {"layers": 4}),
    "trainer_export": ("trainer_export", {"layers": 3}),
    "trainer_export_12_layers": ("trainer_export", {"layers": 12}),
    "experts_spread": ("experts_spread", {"layers": 3, "experts": 8}),
    "moe_trainer_export_11_layers": ("trainer_export", {"layers": 11, "experts": 4}),
    "tied_in_order": ("in_order", {"layers": 2, "tie_word_embeddings": True}),
    # vLLM pads 160 to 192 and holds embed_tokens and lm_head to the end of the stream.
    "padded_vocab_trainer_export": ("trainer_export", {"layers": 3, "vocab": 160}),
}


# --- helpers --------------------------------------------------------------------------------------------------


def _shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"), key=lambda p: natural_key(p.name))


def _tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every tensor read with the safetensors library itself: name -> (dtype, shape, sha256 of its bytes)."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    out = {}
    for path in _shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
                assert name not in out, f"{name} twice"
                out[name] = (str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(raw).hexdigest())
    return out


def _read_order(folder: Path) -> list[tuple[str, str]]:
    """(tensor, shard) in the order vLLM's default loader reads: shards naturally sorted, `safe_open` keys."""
    order = []
    for path in _shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            order += [(name, path.name) for name in f.keys()]  # noqa: SIM118
    return order


def _headers(folder: Path) -> dict[str, TensorEntry]:
    return {t.name: t for path in _shard_files(folder) for t in read_shard_header(path)[0].tensors}


def _check_layer_order(folder: Path, held: frozenset[str] = frozenset()) -> tuple[int, int]:
    """Assert every parent layer is one contiguous run in vLLM's read order; return (peak, largest layer).

    Layers in `held` are ones vLLM holds to the end of the stream.
    """
    config = json.loads((folder / "config.json").read_text())
    mapping = mapping_for_config(config)
    entries = _headers(folder)
    stream = []
    for name, _shard in _read_order(folder):
        parent = mapping.parent_of(name)
        stream.append(PlannedTensor(entries[name], parent.name if parent else None))
    runs: list[str] = []
    for item in stream:
        if item.parent is not None and (not runs or runs[-1] != item.parent):
            runs.append(item.parent)
    assert len(runs) == len(set(runs)), f"a parent layer is read in pieces: {runs}"
    sizes: dict[str, int] = {}
    for item in stream:
        if item.parent is not None:
            sizes[item.parent] = sizes.get(item.parent, 0) + item.entry.nbytes
    return simulate_buffering(stream, "file", held).peak_buffer_bytes, max(sizes.values())


def _digest_tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".layerwise-tmp-" in p.name]


def _invoke(*args: str):
    return runner.invoke(app, ["reorder", *args])


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


def _checkpoint_in_memory(model: SyntheticModel, layout: str, shards: int = 4) -> Checkpoint:
    """Headers only (no files): what `open_checkpoint` would return for a generated checkpoint."""
    shapes = dict(model.tensors())
    headers = []
    for i, names in enumerate(g for g in shard_groups(model, layout, shards) if g):
        offset, tensors = 0, []
        for name in names:
            n = DTYPE_SIZES[model.dtype]
            for d in shapes[name]:
                n *= d
            tensors.append(TensorEntry(name, model.dtype, shapes[name], f"s{i}", offset, offset + n))
            offset += n
        headers.append(ShardHeader(f"model-{i + 1:05d}.safetensors", 0, None, {}, tensors))
    return Checkpoint("memory", "directory", headers, model.config())


def _fast_bytes(name: str, n: int) -> bytes:
    # Bit 6 cleared in every byte: every float finite (--verify refuses NaN and Inf).
    seed = bytes(b & 0xBF for b in hashlib.sha256(name.encode()).digest())
    return (seed * (n // 32 + 1))[:n]


# --- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_keeps_every_tensor_and_reads_in_layer_order(make_checkpoint, tmp_path: Path, case: str) -> None:
    layout, shape = CASES[case]
    src = make_checkpoint(layout, **shape)
    dst = tmp_path / "dst"
    before = inspect_order(str(src))

    result = _invoke(str(src), str(dst), "--verify", "--json")

    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert _tensors(dst) == _tensors(src)  # same names, dtypes, shapes and bytes
    held = frozenset(before.plan.held)
    assert bool(held) == (case == "padded_vocab_trainer_export")
    peak, largest = _check_layer_order(dst, held)  # read with the safetensors library, in vLLM's order
    assert largest == before.plan.largest_layer_bytes
    # The least any order buffers: the largest layer, or the held layers together at the end.
    assert peak == before.plan.least_peak_bytes == max(largest, before.plan.held_bytes())
    after = inspect_order(str(dst))
    assert after.file_order_buffering.peak_buffer_bytes == after.plan.least_peak_bytes == peak
    assert data["after"]["file_order_peak_buffer_bytes"] == peak
    assert data["before"]["file_order_peak_buffer_bytes"] == before.file_order_buffering.peak_buffer_bytes
    if layout in {"trainer_export", "experts_spread"}:
        assert before.file_order_buffering.peak_buffer_bytes > largest  # the case was worth reordering
    assert all(len(layer.shards) == 1 for layer in after.plan.layers)  # 5GB: no layer spans two shards
    assert data["verified"] is True and not _leftovers(tmp_path)


def test_index_metadata_and_other_files_are_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    model = SyntheticModel(layers=3)
    write_checkpoint(src, model, "trainer_export", 4)
    # Extra metadata, as some exporters write; two shards disagree on it.
    shapes = dict(model.tensors())
    for path, exporter in zip(_shard_files(src)[:2], ["trainer-x", "trainer-y"], strict=True):
        header = read_shard_header(path)[0]
        write_safetensors(path, [(t.name, t.dtype, shapes[t.name]) for t in header.tensors],
                          metadata={"format": "pt", "exporter": exporter})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["metadata"]["total_parameters"] = 12345
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    extras = {
        "tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}", "generation_config.json": "{}",
        "README.md": "# a model\n", "assets/notes.txt": "kept\n",
    }
    for name, text in extras.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    dst = tmp_path / "dst"

    # digests: tests/test_reorder_digests_cli.py
    result = reorder(str(src), dst, max_shard_size=64 * 1024, digests=False)

    for name, text in {**extras, "config.json": (src / "config.json").read_text()}.items():
        assert (dst / name).read_text() == text
    assert not (dst / "pytorch_model.bin").exists() and not (dst / ".git").exists()
    assert result.files_skipped == ["pytorch_model.bin"]
    written = json.loads((dst / "model.safetensors.index.json").read_text())
    assert written["metadata"] == {"total_parameters": 12345, "total_size": result.after.plan.total_bytes}
    assert set(written["weight_map"]) == {name for name, _ in model.tensors()}
    for name, shard in written["weight_map"].items():
        assert name in {t.name for t in read_shard_header(dst / shard)[0].tensors}
    shards = _shard_files(dst)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    for path in shards:
        assert read_shard_header(path)[0].metadata == {"format": "pt", "exporter": "trainer-x"}
    assert result.metadata_conflicts == ["exporter"]  # the first shard's value is kept, and the clash reported


def test_single_file_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, SyntheticModel(layers=2), "in_order", 1)
    (src / "tokenizer.json").write_text("{}")
    (src / "unrelated.txt").write_text("not the model's")
    dst = tmp_path / "dst"

    reorder(str(src / "model.safetensors"), dst)

    assert _tensors(dst) == _tensors(src)
    assert sorted(p.name for p in dst.iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json", "model.safetensors.index.json", "tokenizer.json"]


# --- the shard-boundary rule ----------------------------------------------------------------------------------


def test_dense_attention_block_is_split_so_qkv_reads_in_one_run(make_checkpoint, tmp_path: Path) -> None:
    # In one shard, k_proj < o_proj < q_norm < q_proj < v_proj: o_proj and q_norm would split qkv_proj.
    src = make_checkpoint("in_order", shards=1, layers=2)
    reorder(str(src), tmp_path / "dst")
    weight_map = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    for i in range(2):
        attn = f"model.layers.{i}.self_attn."
        qkv = {weight_map[attn + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")}
        assert len(qkv) == 1
        assert weight_map[attn + "o_proj.weight"] not in qkv and weight_map[attn + "q_norm.weight"] not in qkv
    assert len(set(weight_map.values())) == 2  # one shard more than size alone asks for, not one per layer


@pytest.mark.parametrize("limit", ["40KiB", "20KiB", "7KiB"])
def test_max_shard_size(make_checkpoint, tmp_path: Path, limit: str) -> None:
    # 40KiB: several layers per shard; 20KiB: gate_up_proj (32 KiB) alone is larger and is split in
    # shards of its own; 7KiB: single tensors (16 KiB embeddings) are larger than a shard.
    src = make_checkpoint("trainer_export", layers=12)
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst), "--max-shard-size", limit, "--json")
    assert result.exit_code == 0, result.output
    size = {"40KiB": 40 * 1024, "20KiB": 20 * 1024, "7KiB": 7 * 1024}[limit]
    files = _shard_files(dst)
    assert len(files) > 2
    for path in files:
        header = read_shard_header(path)[0]
        assert header.nbytes <= size or len(header.tensors) == 1, path.name
    report = inspect_order(str(dst))
    for layer in report.plan.layers:
        if layer.bytes <= size:
            assert len(layer.shards) == 1, layer.name
        else:  # a layer larger than a shard owns its shards, which are consecutive
            others = {t.entry.shard for t in report.plan.file_order if t.parent not in {layer.name, None}}
            assert not others & set(layer.shards)
            positions = [files.index(dst / s) for s in layer.shards]
            assert positions == list(range(positions[0], positions[0] + len(positions)))
    peak, largest = _check_layer_order(dst)
    assert peak == largest
    assert _tensors(dst) == _tensors(src)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 14),
    experts=st.sampled_from([0, 0, 3, 12]),
    tied=st.booleans(),
    layout=st.sampled_from(["in_order", "split_layer", "trainer_export", "experts_spread"]),
    limit=st.integers(2_000, 400_000),
    vocab=st.sampled_from([64, 40, 200]),
)
def test_plan_shards_property(layers: int, experts: int, tied: bool, layout: str, limit: int, vocab: int) -> None:
    """Any model, order and shard size: each layer one run in vLLM's order, sizes and spans respected.

    With a vocabulary vLLM pads (40, 200), the held layers are read last: the
    peak is the largest layer or the held layers together, whichever is larger.
    """
    if layout == "experts_spread" and not experts:
        layout = "trainer_export"
    model = SyntheticModel(layers=layers, experts=experts, tie_word_embeddings=tied, hidden=32, intermediate=64,
                           head_dim=32, vocab=vocab, moe_intermediate=16)
    checkpoint = _checkpoint_in_memory(model, layout)
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config))

    shards = split_shards(plan, limit)

    rewritten = []
    for shard in shards:
        offset, tensors = 0, []
        for t in shard.tensors:
            tensors.append(TensorEntry(t.name, t.dtype, t.shape, shard.name, offset, offset + t.nbytes))
            offset += t.nbytes
        assert shard.nbytes <= limit or len(shard.tensors) == 1
        rewritten.append(ShardHeader(shard.name, 0, None, {}, tensors))
    assert sorted(t.name for s in rewritten for t in s.tensors) == sorted(t.name for t in checkpoint.tensors)
    after = build_plan(Checkpoint("memory", "directory", rewritten, checkpoint.config), plan.mapping)
    runs = [t.parent for t in after.file_order if t.parent is not None]
    runs = [p for i, p in enumerate(runs) if i == 0 or runs[i - 1] != p]
    assert len(runs) == len(set(runs))
    assert bool(after.held) == bool(vocab % 64)
    assert after.simulate("file").peak_buffer_bytes == after.least_peak_bytes
    for layer in after.layers:
        assert len(layer.shards) == 1 or layer.bytes > limit


# --- CLI output -----------------------------------------------------------------------------------------------


def test_summary_shows_peak_before_and_after(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint("trainer_export", layers=12)
    result = _invoke(str(src), str(tmp_path / "dst"))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "file order before  peak 304.00 KiB = 9.50 x largest layer" in out
    assert "file order after   peak 32.00 KiB = 1.00 x largest layer" in out
    assert "model-00001-of-00002.safetensors" in out and "Shards, in the order vLLM reads them" in out
    assert "writing" in result.stderr  # progress goes to stderr, never stdout


def test_json_keys(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint("experts_spread", layers=2, experts=4)
    result = _invoke(str(src), str(tmp_path / "dst"), "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # --json: no progress
    data = json.loads(result.stdout)
    assert {"source", "destination", "max_shard_size", "tensors", "total_bytes", "bytes_written",
            "largest_layer_bytes", "before", "after", "shards", "files_copied", "verified", "seconds"} <= set(data)
    assert data["max_shard_size"] == 5 * 10**9
    assert data["bytes_written"] == sum(p.stat().st_size for p in _shard_files(tmp_path / "dst"))
    assert sum(s["bytes"] for s in data["shards"]) == data["total_bytes"]


def test_help_shows_an_example_and_stays_light() -> None:
    code = ("import sys\nfrom layerwise_cli.cli.app import app\ntry:\n    app(['reorder', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    assert "Example: layerwise reorder" in out
    assert out.strip().splitlines()[-1] == "False False"


# --- refusals and bad input -----------------------------------------------------------------------------------


def test_existing_destination_needs_force(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint("trainer_export", layers=3)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")

    refused = _invoke(str(src), str(dst))
    assert refused.exit_code == 1
    assert "already exists; pass --force to replace it" in _one_error_line(refused.stderr)
    assert [p.name for p in dst.iterdir()] == ["old.txt"]

    # --force replaces a checkpoint directory only: here, an older checkpoint with a note beside it.
    shutil.copytree(make_checkpoint("in_order", layers=2), dst, dirs_exist_ok=True)
    forced = _invoke(str(src), str(dst), "--force", "--json")
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout)["replaced"] is True
    assert not (dst / "old.txt").exists() and _tensors(dst) == _tensors(src)
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_destination_that_would_clobber_the_source(make_checkpoint, where: str) -> None:
    src = make_checkpoint("in_order", layers=2)
    before = _digest_tree(src)
    dst = {"same": src, "inside": src / "out", "parent": src.parent}[where]
    result = _invoke(str(src), str(dst), "--force")
    assert result.exit_code == 1
    _one_error_line(result.stderr)
    assert _digest_tree(src) == before


def _truncate(folder: Path) -> None:
    path = _shard_files(folder)[1]
    path.write_bytes(path.read_bytes()[:-10])


def _bad_header(folder: Path) -> None:
    path = _shard_files(folder)[0]
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{not json" + data[17:])


@pytest.mark.parametrize("damage, message", [(_truncate, "truncated file?"), (_bad_header, "not valid JSON"),
                                             (None, "no such file or directory")])
def test_bad_source_is_one_line(make_checkpoint, tmp_path: Path, damage, message: str) -> None:
    src = make_checkpoint("trainer_export", layers=3)
    if damage is None:
        src = tmp_path / "missing"
    else:
        damage(src)
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst))
    assert result.exit_code == 1
    assert message in _one_error_line(result.stderr)
    assert not dst.exists() and not _leftovers(tmp_path)


def test_bad_max_shard_size_is_a_usage_error(make_checkpoint, tmp_path: Path) -> None:
    result = _invoke(str(make_checkpoint()), str(tmp_path / "dst"), "--max-shard-size", "lots")
    assert result.exit_code == 2


# --- safe writes ----------------------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"this machine does not let the tests mount a tmpfs: {done.stderr.decode().strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a tmpfs: `tmpfs("ro,size=1m")`; unmounted after the test."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        _mount_tmpfs(where, options)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_read_only_filesystem(make_checkpoint, tmpfs) -> None:
    src = make_checkpoint("trainer_export", layers=3)
    before = _digest_tree(src)
    mount = tmpfs("ro,size=1m")
    result = _invoke(str(src), str(mount / "dst"))
    assert result.exit_code == 1
    assert "Read-only file system" in _one_error_line(result.stderr)
    assert list(mount.iterdir()) == [] and _digest_tree(src) == before


@pytest.mark.parametrize("place", ["sysfs", "under_a_file"])
def test_unwritable_destination(make_checkpoint, tmp_path: Path, place: str) -> None:
    # Tests run as root, where chmod does not stop writes: use places no one can write to.
    src = make_checkpoint("trainer_export", layers=3)
    before = _digest_tree(src)
    if place == "sysfs":
        dst = Path("/sys/layerwise-reorder-test/dst")
    else:
        (tmp_path / "a-file").write_text("x")
        dst = tmp_path / "a-file" / "dst"
    result = _invoke(str(src), str(dst))
    assert result.exit_code == 1
    assert "cannot write beside the destination" in _one_error_line(result.stderr)
    assert not dst.exists() and _digest_tree(src) == before


def test_full_disk_on_a_small_filesystem(make_checkpoint, tmpfs) -> None:
    src = make_checkpoint("trainer_export", layers=12)  # 1.2 MiB of tensors
    before = _digest_tree(src)
    mount = tmpfs("size=512k")
    result = _invoke(str(src), str(mount / "dst"))
    assert result.exit_code == 1
    assert "No space left on device" in _one_error_line(result.stderr)
    assert list(mount.iterdir()) == [] and _digest_tree(src) == before


def test_full_disk_mid_copy(make_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_checkpoint("trainer_export", layers=12)
    before = _digest_tree(src)
    real = write.write_chunk
    written = []

    def fill_up(fd: int, data, offset: int) -> None:
        if offset > 0:  # tensor data (headers go at offset 0)
            written.append(len(data))
            if len(written) > 20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(write, "write_chunk", fill_up)
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst))
    assert result.exit_code == 1
    line = _one_error_line(result.stderr)
    assert "No space left on device" in line and "nothing was put in place" in line
    assert not dst.exists() and not _leftovers(tmp_path) and _digest_tree(src) == before


def test_verify_catches_a_corrupted_write(make_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_checkpoint("trainer_export", layers=3)
    real = write.write_chunk
    state = {"done": False}

    def corrupt_once(fd: int, data, offset: int) -> None:
        if offset > 0 and len(data) and not state["done"]:
            state["done"] = True
            data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
        real(fd, data, offset)

    monkeypatch.setattr(write, "write_chunk", corrupt_once)
    unchecked = _invoke(str(src), str(tmp_path / "unchecked"))
    assert unchecked.exit_code == 0  # the headers are fine: only the bytes tell
    state["done"] = False
    dst = tmp_path / "dst"
    result = _invoke(str(src), str(dst), "--verify")
    assert result.exit_code == 1
    assert "--verify: 1 tensor(s) differ from the source" in _one_error_line(result.stderr)
    assert not dst.exists() and not _leftovers(tmp_path)


_SLOW_CLI = textwrap.dedent("""
    import os, sys, time
    import layerwise_cli.reorder.write as write
    marker, args = sys.argv[1], sys.argv[2:]
    real = write.write_chunk
    def slow(fd, data, offset):
        if offset > 0:  # tensor data: the copy is under way
            if not os.path.exists(marker):
                open(marker, "w").close()
            time.sleep(0.05)
        real(fd, data, offset)
    write.write_chunk = slow
    from layerwise_cli.cli.app import app
    app(["reorder", *args], prog_name="layerwise")
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("existing", [False, True])
def test_signal_mid_write_leaves_no_partial_destination(make_checkpoint, tmp_path: Path, signum: int,
                                                        existing: bool) -> None:
    src = make_checkpoint("trainer_export", layers=12)  # 135 tensors: about 7 s of slowed copying
    dst = tmp_path / "dst"
    if existing:
        write_checkpoint(dst, SyntheticModel(layers=2), "in_order", 2)  # --force replaces only a checkpoint
        (dst / "old.txt").write_text("old")
        before = _digest_tree(dst)
    marker = tmp_path / "copying"
    args = [str(src), str(dst), "--json"] + (["--force"] if existing else [])
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CLI, str(marker), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the copy never started"
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    line = _one_error_line(err)
    assert f"interrupted by {signal.Signals(signum).name}" in line and "temporary files were removed" in line
    assert out == ""
    assert not _leftovers(tmp_path)
    if existing:
        assert _digest_tree(dst) == before
    else:
        assert not dst.exists()


# --- bounded memory -------------------------------------------------------------------------------------------

_PEAK_RSS = textwrap.dedent("""
    import resource, subprocess, sys
    done = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(done.stderr)
    print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    print(done.stdout)
""")


def _run_measured(src: Path, dst: Path, *options: str) -> tuple[int, dict]:
    """Run `layerwise reorder` in a fresh process; return its peak RSS in bytes and its JSON."""
    cmd = [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "layerwise_cli", "reorder", str(src), str(dst),
           "--json", *options]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    first, _, rest = done.stdout.partition("\n")
    code, peak = map(int, first.split())
    assert code == 0, done.stderr
    return peak, json.loads(rest)


@pytest.mark.slow
def test_peak_rss_stays_under_largest_shard_plus_largest_layer(tmp_path: Path) -> None:
    # About 510 MiB of bf16 tensors in two trainer-export shards of ~255 MiB each.
    model = SyntheticModel(layers=16, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=4096, vocab=8192)
    src = tmp_path / "big"
    write_checkpoint(src, model, "trainer_export", 2, data=_fast_bytes)
    small = tmp_path / "small"
    write_checkpoint(small, SyntheticModel(layers=2), "trainer_export", 2, data=_fast_bytes)
    # The constant: the same command on a tiny checkpoint (interpreter, imports, buffers).
    baseline, _ = _run_measured(small, tmp_path / "small-out", "--verify")

    peak, data = _run_measured(src, tmp_path / "big-out", "--max-shard-size", "64MiB", "--verify")

    largest_shard = max(s["bytes"] for s in data["shards"])
    bound = largest_shard + data["largest_layer_bytes"] + baseline + 16 * 2**20
    mib = 2**20
    print(f"\npeak RSS {peak / mib:.1f} MiB (baseline {baseline / mib:.1f} MiB) against a bound of "
          f"{bound / mib:.1f} MiB = largest shard {largest_shard / mib:.1f} + largest layer "
          f"{data['largest_layer_bytes'] / mib:.1f} + baseline + 16; checkpoint {data['total_bytes'] / mib:.1f} MiB")
    assert data["total_bytes"] > 2 * bound  # holding the checkpoint, or a source shard, would break the bound
    assert peak <= bound
    assert data["after"]["file_order_peak_buffer_bytes"] == data["largest_layer_bytes"]


# --- Hub source -----------------------------------------------------------------------------------------------


def test_hub_source_fetches_shards_one_at_a_time(tmp_path: Path) -> None:
    served = tmp_path / "served"
    write_checkpoint(served, SyntheticModel(layers=12), "trainer_export", 4)
    (served / "tokenizer.json").write_text("{}")
    (served / "README.md").write_text("# trainer export\n")
    other = tmp_path / "other"
    write_checkpoint(other, SyntheticModel(layers=2), "in_order", 2)
    local = tmp_path / "local"
    reorder(str(served), local)
    shards = {p.name: p.stat().st_size for p in _shard_files(served)}
    hf_home = tmp_path / "hf_home"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, check=False)

    def full_gets() -> list[str]:
        return sorted(r.path.rsplit("/", 1)[-1] for r in hub.requests
                      if r.method == "GET" and r.path.endswith(".safetensors") and r.range is None)

    with HubServer() as hub:
        hub.add_repo("org/trainer", other)  # main is something else: --revision must be honoured
        hub.add_repo("org/trainer", served, revision="v1")
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1"}
        done = run("-m", "layerwise_cli", "reorder", "org/trainer", str(tmp_path / "from-hub"),
                   "--revision", "v1", "--verify", "--json")
        assert done.returncode == 0, done.stderr
        # Every shard downloaded exactly once (plus its header, read by range before planning) ...
        assert full_gets() == sorted(shards)
        sent = {path.rsplit("/", 1)[-1]: n for path, n in hub.bytes_sent.items() if path.endswith(".safetensors")}
        for name, size in shards.items():
            assert size <= sent[name] < size + 64 * 1024
        # ... and removed after use: no copy is left anywhere.
        assert not list(hf_home.rglob("*.safetensors")) and not _leftovers(tmp_path)

        # A shard already in the Hub cache is read from there, and left there.
        cached = sorted(shards)[1]
        fetch = ("from huggingface_hub import hf_hub_download; "
                 f"hf_hub_download('org/trainer', '{cached}', revision='v1')")
        assert run("-c", fetch).returncode == 0
        hub.reset_counts()
        again = run("-m", "layerwise_cli", "reorder", "org/trainer", str(tmp_path / "again"), "--revision", "v1",
                    "--json")
        assert again.returncode == 0, again.stderr
        assert full_gets() == sorted(set(shards) - {cached})
        assert [p.name for p in hf_home.rglob("*.safetensors")] == [cached]
    # The same bytes as a reorder of the folder itself, and the repo's other files came along.
    assert _digest_tree(tmp_path / "from-hub") == _digest_tree(local) == _digest_tree(tmp_path / "again")
    data = json.loads(done.stdout)
    assert data["source"] == "org/trainer" and data["revision"] == "v1" and data["verified"] is True


def test_a_hub_reorder_reads_the_commit_its_branch_named_at_the_start(tmp_path: Path) -> None:
    """`main` pushed once the reorder pinned it changes nothing: every shard and side file is the start commit's."""
    served, other = tmp_path / "served", tmp_path / "other"
    write_checkpoint(served, SyntheticModel(layers=4), "trainer_export", 3)
    write_checkpoint(other, SyntheticModel(layers=4, hidden=128), "trainer_export", 3)
    reorder(str(served), tmp_path / "local")
    with HubServer() as hub:
        start = hub.add_repo("org/moving", served)
        once_named(hub, start, lambda: hub.move_ref("org/moving", "main", other))
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
        done = subprocess.run([sys.executable, "-m", "layerwise_cli", "reorder", "org/moving",
                               str(tmp_path / "from-hub"), "--json"], capture_output=True, text=True, cwd=REPO,
                              env=env, check=False)
        assert hub.resolve("org/moving", "main").commit != start
    assert done.returncode == 0, done.stderr
    assert _digest_tree(tmp_path / "from-hub") == _digest_tree(tmp_path / "local")


# --- the real engine ------------------------------------------------------------------------------------------


def _reshard_as_trainer_export(src: Path, dst: Path, shards: int = 3) -> None:
    """Write SRC's tensors, byte for byte, grouped by parameter type across layers (a trainer's export order)."""
    dst.mkdir(parents=True)
    entries: dict[str, tuple[TensorEntry, Path, int]] = {}
    for path in _shard_files(src):
        header = read_shard_header(path)[0]
        for t in header.tensors:
            entries[t.name] = (t, path, header.data_start)
    kinds: dict[str, list[str]] = {}
    for name in entries:
        kinds.setdefault(".".join(p for p in name.split(".") if not p.isdigit()), []).append(name)
    by_kind = list(kinds.values())
    groups = [[name for group in by_kind[i::shards] for name in group] for i in range(shards)]

    def data(name: str, n: int) -> bytes:
        entry, path, start = entries[name]
        with open(path, "rb") as f:
            f.seek(start + entry.begin)
            return f.read(n)

    weight_map = {}
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(dst / shard, [(n, entries[n][0].dtype, entries[n][0].shape) for n in names], data,
                          {"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, dst / path.name)


PAIRS = [(a, b) for a in range(10) for b in range(10)]


def _answers(llm) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3)
    outputs = llm.generate([demo_prompt(a, b) for a, b in PAIRS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs]


def _texts(llm) -> list[str]:
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    outputs = llm.generate([demo_prompt(a, b) for a, b in PAIRS], SamplingParams(temperature=0.0, max_tokens=3),
                           use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outputs]


def _start_engine(model: Path):
    """An engine on MODEL in this process (`start_here`): vLLM's loader reads it as in any engine; the start takes
    seconds, where one with processes of its own took 30 s or more on the 2-core CI machine."""
    return start_here(str(model), EngineOptions(max_model_len=64, seed=0))


def _stop_engine(llm) -> None:
    stop_here(llm)


@pytest.fixture(scope="module")
def engine_on_dst(tmp_path_factory: pytest.TempPathFactory):
    """One engine at a time: first on SRC (answers recorded, then shut down), then on DST, kept for the module."""
    root = tmp_path_factory.mktemp("reorder-engine")
    cache = root / "demo-cache"
    paths = {}
    for name in ("multiply", "add"):
        src = root / f"{name}-src"
        _reshard_as_trainer_export(demo_checkpoint(name, cache), src)
        reorder(str(src), root / f"{name}-dst", max_shard_size=48 * 1024, verify=True)
        paths[name] = (src, root / f"{name}-dst")
    src, dst = paths["multiply"]
    before = inspect_order(str(src))
    assert before.file_order_buffering.peak_buffer_bytes > before.plan.largest_layer_bytes
    llm = _start_engine(src)
    reference = _answers(llm)
    _stop_engine(llm)
    llm = _start_engine(dst)
    yield llm, reference, paths
    _stop_engine(llm)


@pytest.mark.engine
def test_engine_on_destination_answers_exactly_as_on_source(engine_on_dst) -> None:
    llm, reference, _ = engine_on_dst
    assert _answers(llm) == reference  # greedy tokens and top-3 logprobs, all 100 prompts
    assert _texts(llm) == [expected_answer("multiply", a, b) for a, b in PAIRS]


@pytest.mark.engine
def test_vllm_reload_weights_from_a_reordered_checkpoint(engine_on_dst) -> None:
    llm, reference, paths = engine_on_dst
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths["add"][1])})
    assert _texts(llm) == [expected_answer("add", a, b) for a, b in PAIRS]
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(paths["multiply"][1])})
    assert _answers(llm) == reference
