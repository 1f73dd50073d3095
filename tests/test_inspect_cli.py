"""`layerwise inspect-order` end to end: JSON keys, tables, --top, --max-buffer, source kinds."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.cli import inspect_order as command
from layerwise_cli.cli.app import app
from layerwise_cli.planning.chart import stream_curves
from layerwise_cli.planning.inspect import inspect_order
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

runner = CliRunner()
# The dense model of test_plan_logic: largest parent layer 768 bytes (gate_up_proj);
# its vocabulary (32) is padded by vLLM, so embed_tokens and lm_head (1024
# bytes together) are held to the end of the stream: in trainer-export order
# over 4 shards vLLM's read order buffers 2304, layer order 1024.
DENSE = {"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4, "intermediate": 24, "vocab": 32}


@pytest.fixture
def trainer_export(tmp_path: Path) -> Path:
    folder = tmp_path / "trainer-export"
    write_checkpoint(folder, SyntheticModel(**DENSE), "trainer_export", 4)
    return folder


def run_json(*args: str) -> dict:
    result = runner.invoke(app, ["inspect-order", *args, "--json"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def test_json_has_the_documented_keys(trainer_export: Path) -> None:
    data = run_json(str(trainer_export), "--top", "0")
    model = SyntheticModel(**DENSE)
    assert data["tensors"] == len(model.tensors()) == 25
    assert data["total_bytes"] == sum(2 * _numel(shape) for _, shape in model.tensors())
    assert data["largest_layer_bytes"] == 768
    assert data["file_order"]["peak_buffer_bytes"] == 2304
    assert data["layer_order"]["peak_buffer_bytes"] == 1024
    assert data["tensor_parallel_size"] == 1 and data["held_to_end_bytes"] == 1024
    assert data["held_to_end"] == [
        {"name": "model.embed_tokens", "reason": "vocabulary padded 32 -> 64", "bytes": 512, "ranks": [0]},
        {"name": "lm_head", "reason": "vocabulary padded 32 -> 64", "bytes": 512, "ranks": [0]},
    ]
    assert "model.embed_tokens, lm_head" in data["layer_order"]["above_largest_layer_because"]
    by_name = {layer["name"]: layer for layer in data["layers"]}
    assert by_name["lm_head"]["held_to_end"] == "vocabulary padded 32 -> 64"
    assert by_name["model.norm"]["held_to_end"] is None
    assert data["mapping"]["kind"] == "table" and data["mapping"]["architecture"] == "Qwen3ForCausalLM"
    assert all({"name", "bytes", "tensors"} <= set(layer) for layer in data["layers"])
    assert sum(layer["bytes"] for layer in data["layers"]) == data["total_bytes"]
    assert sum(layer["tensors"] for layer in data["layers"]) == data["tensors"]
    assert max(layer["bytes"] for layer in data["layers"]) == data["largest_layer_bytes"]
    # Bytes are exact integers in JSON.
    assert all(isinstance(layer["bytes"], int) for layer in data["layers"])
    assert data["kind"] == "directory" and data["shards"] == 4
    # Headers only: the bytes read are the four headers, not the data.
    assert 0 < data["header_bytes_read"] == sum(_header_bytes(p) for p in trainer_export.glob("*.safetensors"))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_layers_are_worst_first_and_top_limits_them(trainer_export: Path) -> None:
    everything = run_json(str(trainer_export), "--top", "0")["layers"]
    assert len(everything) == 2 * 8 + 3
    held = [layer["file_order_held_bytes"] for layer in everything]
    assert held == sorted(held, reverse=True) and held[0] > 0
    top3 = run_json(str(trainer_export), "--top", "3")["layers"]
    assert top3 == everything[:3]


def test_max_buffer_gate(trainer_export: Path) -> None:
    # File-order peak 2304 bytes: a limit at the peak passes, one byte less fails.
    ok = runner.invoke(app, ["inspect-order", str(trainer_export), "--max-buffer", "2304", "--json"])
    assert ok.exit_code == 0, ok.stderr
    assert runner.invoke(app, ["inspect-order", str(trainer_export), "--max-buffer", "3KiB"]).exit_code == 0
    fail = runner.invoke(app, ["inspect-order", str(trainer_export), "--max-buffer", "2303", "--json"])
    assert fail.exit_code == 1
    assert json.loads(fail.stdout)["file_order"]["peak_buffer_bytes"] == 2304  # the data still comes out
    [line] = fail.stderr.splitlines()
    assert line.startswith(f"Error: {trainer_export}: file-order peak buffer") and "(2304 bytes)" in line


def test_table_on_stdout_warning_on_stderr(trainer_export: Path) -> None:
    result = runner.invoke(app, ["inspect-order", str(trainer_export), "--top", "5"])
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for text in ("Qwen3ForCausalLM: layerwise's architecture table", "file order peak", "layer order peak",
                 "3.00 x largest layer", "1.33 x largest layer", "Parent layers, worst first (top 5)",
                 "held in file order", "held to end", "model.embed_tokens, lm_head: 1.00 KiB",
                 "vocabulary padded 32 -> 64",
                 "layer order is above the largest layer: the layers held to the end, together"):
        assert text in out, text
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 5
    assert "File order buffers 3.00x the largest layer" in result.stderr
    assert "File order buffers" not in out


def test_no_warning_when_file_order_is_fine(tmp_path: Path) -> None:
    folder = tmp_path / "ok"
    # A vocabulary vLLM does not pad (64): nothing is held to the end.
    write_checkpoint(folder, SyntheticModel(**{**DENSE, "vocab": 64}), "in_order", 1)
    result = runner.invoke(app, ["inspect-order", str(folder)])
    assert result.exit_code == 0 and result.stderr == ""
    assert "1.00 x largest layer" in result.stdout
    assert "held to end" not in result.stdout


def test_json_is_all_of_stdout_and_stderr_stays_quiet(trainer_export: Path) -> None:
    result = runner.invoke(app, ["inspect-order", str(trainer_export), "--json"])
    assert result.exit_code == 0
    json.loads(result.stdout)  # nothing else on stdout
    assert result.stderr == ""  # no warning, no progress


def test_tensor_names_with_markup_are_escaped(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, [("weird.[bold]x[/bold].weight", "U8", (4,))])
    result = runner.invoke(app, ["inspect-order", str(path)])
    assert result.exit_code == 0, result.stderr
    assert "[bold]x[/bold]" in result.stdout


def test_single_file_source(tmp_path: Path) -> None:
    folder = tmp_path / "single"
    write_checkpoint(folder, SyntheticModel(**DENSE), "in_order", 1)
    shard = folder / "model.safetensors"
    data = run_json(str(shard))
    assert data["kind"] == "file" and data["shards"] == 1 and data["tensors"] == 25
    assert data["mapping"]["kind"] == "table"  # config.json beside the file is used
    assert data["file_order"]["peak_buffer_bytes"] == 768 + 1024  # see test_plan_logic.test_in_order_single_shard
    # Without a config.json beside it, the generic mapping says so.
    alone = tmp_path / "alone.safetensors"
    shutil.copy(shard, alone)
    data = run_json(str(alone))
    assert data["mapping"]["kind"] == "generic"


def test_directory_without_index(tmp_path: Path, trainer_export: Path) -> None:
    with_index = run_json(str(trainer_export), "--top", "0")
    folder = tmp_path / "no-index"
    shutil.copytree(trainer_export, folder)
    (folder / "model.safetensors.index.json").unlink()
    without = run_json(str(folder), "--top", "0")
    for doc in (with_index, without):
        doc.pop("source")
    assert without == with_index


def test_help_shows_an_example() -> None:
    result = runner.invoke(app, ["inspect-order", "--help"])
    assert result.exit_code == 0 and "layerwise inspect-order ./checkpoint" in result.stdout


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_reads_only_the_header_bytes(trainer_export: Path) -> None:
    # What the kernel handed this process: the shards' prefixes and headers,
    # config.json and the index, not one byte more (a buffered reader would
    # pull 8 KiB of each shard for its 8-byte prefix).
    open_checkpoint(str(trainer_export))  # imports and lazy set-up out of the way
    probe = _rchar()
    probe = _rchar() - probe  # reading /proc/self/io counts too
    before = _rchar()
    checkpoint = open_checkpoint(str(trainer_export))
    read = _rchar() - before - probe
    headers = sum(_header_bytes(p) for p in trainer_export.glob("*.safetensors"))
    json_files = sum((trainer_export / n).stat().st_size for n in ("config.json", "model.safetensors.index.json"))
    assert checkpoint.header_bytes_read == headers
    assert read == headers + json_files
    # Every shard has tensor data after its header, so any over-read would show.
    assert all(p.stat().st_size > _header_bytes(p) for p in trainer_export.glob("*.safetensors"))


def test_the_table_is_drawn_from_the_json_data_alone(trainer_export: Path, monkeypatch) -> None:
    """Data flows one way: the renderer reads what `--json` prints, never the plan behind it."""
    data = json.loads(json.dumps(inspect_order(str(trainer_export)).to_dict(top=0)))
    out = io.StringIO()
    monkeypatch.setattr(command, "stdout", Console(file=out, width=200, no_color=True))
    command.render(data, 0)
    text = " ".join(out.getvalue().split())
    files = sum(path.stat().st_size for path in trainer_export.glob("*.safetensors"))
    assert f"{data['header_bytes_read']} header bytes of {files}" in text
    assert "Parent layers, worst first" in text and "model.layers.0.mlp.gate_up_proj" in text


# --- --plot: the buffered bytes over the stream, as a picture ------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature and the chunk's type."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR", "a PNG starts with its IHDR chunk"
    assert data[-8:-4] == b"IEND", "a complete PNG ends with IEND"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_writes_a_png_beside_the_json(make_checkpoint, tmp_path: Path) -> None:
    folder = make_checkpoint(layout="trainer_export", layers=4)
    chart = tmp_path / "order.png"
    result = runner.invoke(app, ["inspect-order", str(folder), "--plot", str(chart), "--json"])
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)  # stdout is still all JSON; the chart is named on stderr
    assert str(chart) in result.stderr
    width, height = _png_size(chart)
    assert 400 <= width <= 4000 and 300 <= height <= 4000, (width, height)
    assert chart.stat().st_size > 10_000  # two curves, axes and a legend, not an empty canvas


def test_plot_curves_are_the_planners_figures(make_checkpoint) -> None:
    report = inspect_order(str(make_checkpoint(layout="trainer_export", layers=4)))
    curves = stream_curves(report)
    for order, sim in (("file", report.file_order_buffering), ("layer", report.layer_order_buffering)):
        curve = curves[order]
        assert len(curve["delivered_bytes"]) == len(curve["buffered_bytes"]) == len(report.plan.file_order)
        assert curve["delivered_bytes"][-1] == report.plan.total_bytes
        assert max(curve["buffered_bytes"]) == sim.peak_buffer_bytes
    # The point of the picture: this layout buffers more in file order than in layer order.
    assert max(curves["file"]["buffered_bytes"]) > max(curves["layer"]["buffered_bytes"])


@pytest.mark.parametrize("where", ["missing-dir/order.png", "a-file/order.png"])
def test_plot_to_an_unwritable_path_is_one_line_naming_it(make_checkpoint, tmp_path: Path, where: str) -> None:
    folder = make_checkpoint()
    (tmp_path / "a-file").write_text("not a directory\n")
    chart = tmp_path / where
    result = runner.invoke(app, ["inspect-order", str(folder), "--plot", str(chart)])
    assert result.exit_code == 1
    [line] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert line.startswith(f"Error: {chart}: cannot write the chart: "), result.stderr
    assert result.stderr.endswith(line + "\n")  # the last line, after the table and the warning
    assert not chart.exists()


def test_plot_with_an_unknown_suffix_is_refused(make_checkpoint, tmp_path: Path) -> None:
    chart = tmp_path / "order.txt"
    result = runner.invoke(app, ["inspect-order", str(make_checkpoint()), "--plot", str(chart)])
    assert result.exit_code == 1
    assert f"Error: {chart}: cannot tell the chart's format from the suffix '.txt'" in result.stderr
    assert not chart.exists()


def test_plot_without_matplotlib_names_the_package(make_checkpoint, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    chart = tmp_path / "order.png"
    result = runner.invoke(app, ["inspect-order", str(make_checkpoint()), "--plot", str(chart)])
    assert result.exit_code == 1
    assert (f"Error: {chart}: the chart needs matplotlib, which is not installed: pip install 'layerwise[plot]'"
            in result.stderr)
    assert not chart.exists()


def test_help_names_the_plot_extra() -> None:
    # `[plot]` is Rich markup unless escaped: the help would say `pip install 'layerwise'`.
    result = runner.invoke(app, ["inspect-order", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "pip install 'layerwise[plot]'" in result.stdout
