"""NaN/Inf checks: the torch path (in the workers), the raw-bytes path (reorder, inspect-order --scan), the stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.format.finite import ByteScan, count_nonfinite, first_nonfinite, suspect_flag
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import inspect_order
from tests.support.hub_server import HubServer
from tests.support.synthetic import SyntheticModel, write_checkpoint

runner = CliRunner()

FLOATS = ["F64", "F32", "F16", "BF16"]


def _torch_dtype(name: str):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[name]


def _planted(dtype: str, n: int = 10_000, nan: tuple[int, ...] = (), inf: tuple[int, ...] = ()):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    values = torch.linspace(-3, 3, n, dtype=torch.float32)
    for i in nan:
        values[i] = float("nan")
    for k, i in enumerate(inf):
        values[i] = float("inf") if k % 2 == 0 else float("-inf")
    return values.to(_torch_dtype(dtype))


def _raw(tensor) -> bytes:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", FLOATS + ["F8_E5M2"])
def test_counts_nan_and_inf_for_every_float_dtype(dtype):
    tensor = _planted(dtype, nan=(0, 17, 9999), inf=(5, 600))
    assert bool(suspect_flag(tensor))
    assert count_nonfinite(tensor) == (3, 2)
    # The same bytes, raw, in chunks that split elements (the remainder waits for the next chunk).
    raw = _raw(tensor)
    scan = ByteScan(dtype)
    for start in range(0, len(raw), 777):
        scan.update(memoryview(raw)[start:start + 777])
    assert (scan.nan, scan.inf) == (3, 2)
    finite = _planted(dtype)
    assert not bool(suspect_flag(finite)) and count_nonfinite(finite) == (0, 0)
    clean = ByteScan(dtype)
    clean.update(_raw(finite))
    assert not clean.found


def test_e4m3_has_nan_only_and_saturates_instead_of_inf():
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensor = _planted("F8_E4M3", nan=(3, 4))
    assert count_nonfinite(tensor) == (2, 0)
    # 0xFF is a NaN too (sign set), and 0x7E (448, the largest value) is finite.
    raw = torch.tensor([0x7E, 0xFE, 0xFF, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert bool(suspect_flag(raw)) and count_nonfinite(raw) == (1, 0)
    scan = ByteScan("F8_E4M3")
    scan.update(bytes([0x7E, 0xFE, 0xFF, 0x00, 0x7F]))
    assert (scan.nan, scan.inf) == (2, 0)


def test_integer_and_packed_dtypes_are_skipped():
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    ints = torch.full((100,), -1, dtype=torch.int32)  # every bit set: a NaN pattern, were it a float
    assert suspect_flag(ints) is None and count_nonfinite(ints) == (0, 0)
    for dtype in ("I32", "U8", "BOOL", "F4", "I64"):
        scan = ByteScan(dtype)
        scan.update(b"\xff" * 64)
        assert not scan.checked and not scan.found


def test_a_finite_tensor_whose_sum_overflows_is_not_refused():
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    big = torch.full((1000,), 60000.0, dtype=torch.float16)  # the float16 sum overflows to inf
    assert bool(suspect_flag(big))  # suspected by the cheap check ...
    assert first_nonfinite([("w", "s.safetensors", big)]) is None  # ... cleared by the exact count


def test_first_nonfinite_names_the_tensor():
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    group = [("a", "one.safetensors", torch.ones(10)), ("n", "one.safetensors", torch.arange(5)),
             ("b", "two.safetensors", _planted("BF16", nan=(1, 2, 3))),
             ("c", "two.safetensors", _planted("F32", inf=(0,)))]
    found = first_nonfinite(group)
    assert (found.name, found.shard, found.nan, found.inf) == ("b", "two.safetensors", 3, 0)
    assert found.describe() == "tensor b has 3 NaN and 0 Inf values"
    assert first_nonfinite(group[:2]) is None


# --- checkpoints on disk ---------------------------------------------------------------------------

def _write(folder: Path, bad: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None) -> Path:
    """A small two-layer Qwen3-shaped checkpoint, real values; BAD plants NaN/Inf at (nan, inf) indices."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    model = SyntheticModel(layers=2)
    shapes = dict(model.tensors())

    def data(name: str, nbytes: int) -> bytes:
        generator = torch.Generator().manual_seed(len(name))
        tensor = torch.randn(shapes[name], generator=generator).to(torch.bfloat16).reshape(-1)
        if bad and name in bad:
            nan, inf = bad[name]
            for i in nan:
                tensor[i] = float("nan")
            for i in inf:
                tensor[i] = float("inf")
        raw = _raw(tensor)
        assert len(raw) == nbytes
        return raw

    write_checkpoint(folder, model, "in_order", 2, data=data)
    return folder


DOWN = "model.layers.1.mlp.down_proj.weight"


def _stream(folder: Path, **kwargs) -> list[str]:
    """Names handed over by `read_in_order` in layer order, until it raises (the error is returned last)."""
    from layerwise_cli.worker.stream.read_ahead import read_in_order  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    plan = inspect_order(str(folder)).plan
    names: list[str] = []
    try:
        for item, _tensor in read_in_order(plan.layer_order, folder, **kwargs):
            names.append(item.entry.name)
    except LayerwiseError as exc:
        names.append(f"ERROR {exc}")
    return names


@pytest.mark.parametrize("readahead", [True, False])
def test_stream_refuses_a_layer_before_any_of_its_tensors_is_handed_over(tmp_path, readahead):
    clean = _stream(_write(tmp_path / "clean"), readahead=readahead)
    assert not any(name.startswith("ERROR") for name in clean)
    bad = _write(tmp_path / "bad", {DOWN: ((1, 2, 3), ())})
    got = _stream(bad, readahead=readahead)
    plan = inspect_order(str(bad)).plan
    parent = next(item.parent for item in plan.layer_order if item.entry.name == DOWN)
    before = [item.entry.name for item in plan.layer_order[:next(
        i for i, item in enumerate(plan.layer_order) if item.parent == parent)]]
    assert got[:-1] == before  # every earlier layer, none of the bad layer's tensors
    shard = next(t.shard for t in plan.checkpoint.tensors if t.name == DOWN)
    assert got[-1] == (f"ERROR {bad / shard}: tensor {DOWN} has 3 NaN and 0 Inf values; refusing "
                       "(use --allow-nonfinite to load anyway)")
    assert _stream(bad, readahead=readahead, check_finite=False) == clean


def test_stream_refuses_the_first_layer(tmp_path):
    bad = _write(tmp_path / "bad", {"model.embed_tokens.weight": ((), (7,))})
    got = _stream(bad)
    assert len(got) == 1 and "model.embed_tokens.weight has 0 NaN and 1 Inf values" in got[0]


def test_inspect_order_scan(tmp_path):
    clean = _write(tmp_path / "clean")
    ok = runner.invoke(app, ["inspect-order", str(clean), "--scan"])
    assert ok.exit_code == 0, ok.output
    assert "no NaN or Inf" in ok.stdout
    bad = _write(tmp_path / "bad", {DOWN: ((1, 2, 3), ()), "model.norm.weight": ((), (0, 1))})
    result = runner.invoke(app, ["inspect-order", str(bad), "--scan", "--json"])
    assert result.exit_code == 1
    scan = json.loads(result.stdout)["scan"]
    assert {(f["name"], f["nan"], f["inf"]) for f in scan["nonfinite"]} == {(DOWN, 3, 0), ("model.norm.weight", 0, 2)}
    assert scan["tensors"] == scan["tensors_checked"] and scan["bytes"] > 0
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    shard = next(f["shard"] for f in scan["nonfinite"] if f["name"] == DOWN)
    assert line.startswith(f"Error: {bad / shard}: tensor ")
    assert "NaN" in line and "2 tensors hold NaN or Inf" in line
    # Without --scan, nothing but headers is read: no verdict on the data.
    assert runner.invoke(app, ["inspect-order", str(bad)]).exit_code == 0


def test_reorder_verify_refuses_nonfinite_unless_allowed(tmp_path):
    bad = _write(tmp_path / "bad", {DOWN: ((1, 2, 3), (9,))})
    refused = runner.invoke(app, ["reorder", str(bad), str(tmp_path / "out"), "--verify"])
    assert refused.exit_code == 1
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert f"tensor {DOWN} has 3 NaN and 1 Inf values" in line and "--allow-nonfinite" in line
    assert "nothing was put in place" in line and str(bad) in line
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary left
    # Without --verify no data is checked (reorder copies bytes as they are).
    assert runner.invoke(app, ["reorder", str(bad), str(tmp_path / "plain")]).exit_code == 0
    allowed = runner.invoke(app, ["reorder", str(bad), str(tmp_path / "out"), "--verify", "--allow-nonfinite",
                                  "--json"])
    assert allowed.exit_code == 0, allowed.output
    data = json.loads(allowed.stdout)
    assert data["verified"] and [(f["name"], f["nan"], f["inf"]) for f in data["nonfinite"]] == [(DOWN, 3, 1)]
    usage = runner.invoke(app, ["reorder", str(bad), str(tmp_path / "x"), "--allow-nonfinite"])
    assert usage.exit_code == 2 and "--verify" in usage.stderr


def test_reorder_verify_on_a_clean_checkpoint_says_so(tmp_path):
    clean = _write(tmp_path / "clean")
    result = runner.invoke(app, ["reorder", str(clean), str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert "no NaN/Inf" in result.stdout


def test_inspect_order_scan_of_a_hub_repo(tmp_path):
    """A Hub source is scanned shard by shard through the Hub cache; the error names repo and shard."""
    bad = _write(tmp_path / "bad", {DOWN: ((5,), (6, 7))})
    server = HubServer()
    server.add_repo("org/bad", bad)
    with server:
        code = ("import sys\nfrom layerwise_cli.cli.app import main\n"
                "sys.argv = ['layerwise', 'inspect-order', 'org/bad', '--scan', '--json']\nmain()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 1, proc.stderr
    scan = json.loads(proc.stdout)["scan"]
    assert [(f["name"], f["nan"], f["inf"]) for f in scan["nonfinite"]] == [(DOWN, 1, 2)]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert line.startswith(f"Error: org/bad/{scan['nonfinite'][0]['shard']}: tensor {DOWN} has 1 NaN and 2 Inf")
