"""The reload benchmark's delta checkpoints change exactly the layers they say, and carry true header digests."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from benchmarks.bench_delta import CHANGED_FRACTION, changed_layers, write_delta_checkpoints
from layerwise_cli.cli.app import app
from tests.support.digest_support import independent_digests
from tests.support.synthetic import SyntheticModel, normal_weights

runner = CliRunner()


def _inspect(path: str, *options: str) -> dict:
    result = runner.invoke(app, ["inspect-order", path, "--json", "--top", "0", *options])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _layer_digests(data: dict) -> dict[str, str | None]:
    return {row["name"]: row["digest"] for row in data["layers"]}


def test_delta_checkpoints(tmp_path: Path) -> None:
    model = SyntheticModel(layers=4, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=64, vocab=128)
    data = normal_weights(model)
    tokenizer = tmp_path / "no-tokenizer"
    tokenizer.mkdir()
    delta = write_delta_checkpoints(tmp_path / "delta", model, tokenizer, data, ["f", "g", "g-plain", "h"])

    base = _inspect(delta["base"]["path"], "--scan")
    layers = _layer_digests(base)
    assert None not in layers.values() and base["scan"]["digests_checked"] == base["tensors"]
    changed = set(delta["changed_layers"])
    assert len(changed) == round(CHANGED_FRACTION * len(layers)) == round(CHANGED_FRACTION * delta["parent_layers"])

    # f: exactly the chosen layers differ from base, every tensor of them, and its digests are true.
    f = _inspect(delta["f"]["path"], "--scan")
    assert f["scan"]["digest_mismatches"] == [] and f["scan"]["nonfinite"] == []
    assert {name for name, digest in _layer_digests(f).items() if digest != layers[name]} == changed
    before, after = base["header_digests"]["tensors"], f["header_digests"]["tensors"]
    parent_of = changed_layers(Path(delta["base"]["path"]))[1]
    assert {name for name in before if before[name] != after[name]} == {
        name for name, parent in parent_of.items() if parent in changed}
    assert delta["changed_bytes"] == sum(row["bytes"] for row in base["layers"] if row["name"] in changed)

    # g: base's very files, elsewhere; g-plain: the same tensors without header digests.
    g = _inspect(delta["g"]["path"])
    assert _layer_digests(g) == layers and g["source"] != base["source"]
    plain = _inspect(delta["g-plain"]["path"])
    assert plain["header_digests"]["shards_with_digests"] == 0
    assert independent_digests(Path(delta["g-plain"]["path"])) == before

    # h: the writer's layout of f's tensors, with the same digests, read in layer order by vLLM's loader.
    h = _inspect(delta["h"]["path"], "--scan")
    assert h["header_digests"]["tensors"] == after and h["scan"]["digest_mismatches"] == []
    assert h["file_order"]["peak_buffer_bytes"] == h["largest_layer_bytes"]
    assert _layer_digests(h) == _layer_digests(f)

    # s: a sparse delta against base, of a full step with 3% of every tensor's values changed.
    sparse = write_delta_checkpoints(tmp_path / "delta", model, tokenizer, data, ["s"])["s"]
    full = _inspect(sparse["full_path"], "--scan")
    assert full["scan"]["digest_mismatches"] == []
    # Every layer changed, but a layer of a few dozen values (a norm) may have none of them drawn.
    same = {name for name, digest in _layer_digests(full).items() if digest == layers[name]}
    sizes = {row["name"]: row["bytes"] for row in base["layers"]}
    assert all(sizes[name] <= 1024 for name in same) and len(same) < len(layers) / 4
    described = _inspect(sparse["path"], "--scan")  # the delta, read as the full step it rebuilds
    assert described["delta"] is not None and _layer_digests(described) == _layer_digests(full)
    total = sum(row["bytes"] for row in base["layers"])
    assert 0.02 * total < sparse["changed_values"] * 2 < 0.04 * total
    assert sparse["bytes"] < 0.15 * sparse["full_bytes"]

    # Written again with the same arguments, every folder is reused as it is.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "delta").rglob("*.safetensors")}
    again = write_delta_checkpoints(tmp_path / "delta", model, tokenizer, data, ["f", "g", "g-plain", "h"])
    assert again["h"] == delta["h"] and again["f"] == delta["f"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "delta").rglob("*.safetensors")} == stamps


def test_the_write_limit_writes_the_full_step(tmp_path: Path) -> None:
    """Case s's write limit (p) writes the delta into copies of its base: the result is the full step, tensor by
    tensor, so the time it measures is that of the whole patch."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    from benchmarks.bench_patch_floor import patch_writes, write_all  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    model = SyntheticModel(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=64, vocab=128)
    tokenizer = tmp_path / "no-tokenizer"
    tokenizer.mkdir()
    delta = write_delta_checkpoints(tmp_path / "delta", model, tokenizer, normal_weights(model), ["s"])
    writes = patch_writes(delta["s"]["path"], torch.device("cpu"))
    full = {}
    for shard in Path(delta["s"]["full_path"]).glob("*.safetensors"):
        full.update(load_file(shard))
    # Before: every target is its base tensor, which differs from the full step (none passes unwritten).
    assert len(writes) > len(full) // 2
    assert all(not torch.equal(write.target, full[write.name].view(torch.int16).flatten()) for write in writes)
    assert write_all(writes) > 0
    for write in writes:
        assert torch.equal(write.target, full[write.name].view(torch.int16).flatten()), write.name


def test_an_rl_case_changes_the_share_an_adamw_step_changes(tmp_path: Path) -> None:
    """Case rl-1e-5: the share of values one AdamW step at lr 1e-5 changes in bf16, measured in the same run, is
    the share its full step changes, and its delta rebuilds that full step."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    from benchmarks.bench_patch_floor import patch_writes, write_all  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    model = SyntheticModel(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=64, vocab=128)
    tokenizer = tmp_path / "no-tokenizer"
    tokenizer.mkdir()
    case = write_delta_checkpoints(tmp_path / "delta", model, tokenizer, normal_weights(model), ["rl-1e-5"])["rl-1e-5"]
    assert case["adamw"]["lr"] == 1e-5 and 0.01 < case["adamw"]["changed_fraction"] < 0.5
    assert abs(case["changed_fraction"] - case["adamw"]["changed_fraction"]) < 0.01
    full = {}
    for shard in Path(case["full_path"]).glob("*.safetensors"):
        full.update(load_file(shard))
    writes = patch_writes(case["path"], torch.device("cpu"))
    write_all(writes)
    assert all(torch.equal(write.target, full[write.name].view(torch.int16).flatten()) for write in writes)
