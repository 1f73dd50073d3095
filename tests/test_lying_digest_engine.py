"""A header digest that lies: the skip spot-checks it, `--verify` and the scans read every byte.

A layer whose header digest equals the one the engine recorded is skipped
only after the spot check (`worker.spot_check`): a sample of each of its
tensors' bytes in the file (head, middle, tail: the demo's tensors are taken
whole) must equal the sample recorded when the engine loaded the layer. A
shard rewritten with its old `__metadata__` (the issue's repro: `reorder add
add_lw`, then multiply's tensors saved with `metadata=f.metadata()`) has every
layer reloaded and its files named as stale; one tensor's bytes changed under
its old digest has just its layer reloaded. `inspect-order --scan` /
`reorder` hash every byte against the headers, and the honest case still
holds: `reorder`'s header digests let a reload skip every unchanged layer
without streaming it. One engine (the demo `multiply` model), started once for
the module; every reload lands on multiply's content, so the fresh reference
is the engine's own first answers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from layerwise_cli import save_checkpoint
from layerwise_cli.checkpoint.format.finite import scan_checkpoint
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.client.engine.in_process import EngineOptions, reload, verify_engine
from layerwise_cli.demo import demo_prompt
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.reorder.rewrite import reorder
from tests.support.engine_support import assert_matches_fresh, load_tensors, remember_fresh
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

LIAR = "model.layers.0.mlp.down_proj.weight"  # its bytes change, its header digest does not
LIAR_LAYER = "model.layers.0.mlp.down_proj"
PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3), (5, 7), (0, 9)]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def _save(tensors: dict, folder: Path, model_dir: Path) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    save_checkpoint(iter(sorted(tensors.items())), folder, config=config, max_shard_size=64 * 1024, marker=None)
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(path, folder / path.name)
    return folder


def _lie(good: Path, liar: Path, new_bytes: bytes) -> Path:
    """A copy of GOOD whose LIAR tensor holds NEW_BYTES, every header (its digests) left as it was."""
    shutil.copytree(good, liar)
    for path in liar.glob("*.safetensors"):
        header, _ = read_shard_header(path)
        entry = next((t for t in header.tensors if t.name == LIAR), None)
        if entry is not None:
            assert len(new_bytes) == entry.nbytes
            raw = bytearray(path.read_bytes())
            raw[header.data_start + entry.begin: header.data_start + entry.end] = new_bytes
            path.write_bytes(bytes(raw))
            return liar
    raise AssertionError(f"{LIAR} not found")


@pytest.fixture(scope="module")
def engine(demo_models, tmp_path_factory):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    root = tmp_path_factory.mktemp("lying-digest")
    a, b = Path(demo_models["multiply"]), Path(demo_models["add"])
    tensors_a, tensors_b = load_tensors(a), load_tensors(b)
    assert not torch.equal(tensors_a[LIAR], tensors_b[LIAR])
    # HELD: multiply with LIAR taken from add, true digests. LIAR: HELD's headers over multiply's bytes, so only
    # LIAR's header digest is stale, and the content is multiply's (the fresh reference the engine starts on).
    good = _save({**tensors_a, LIAR: tensors_b[LIAR]}, root / "held", a)
    liar = _lie(good, root / "liar", tensors_a[LIAR].contiguous().view(torch.uint8).numpy().tobytes())
    llm = start_here(str(a), EngineOptions(max_model_len=64))
    try:
        remember_fresh(llm, a, prompts())
        yield llm, good, liar
    finally:
        stop_here(llm)


def test_the_scans_catch_the_lie(engine):
    _, good, liar = engine
    assert scan_checkpoint(open_checkpoint(str(good))).digest_mismatches == ()
    found = scan_checkpoint(open_checkpoint(str(liar))).digest_mismatches
    assert [m.name for m in found] == [LIAR]
    with pytest.raises(LayerwiseError, match=f"tensor {LIAR}: its bytes do not match"):
        reorder(str(liar), liar.parent / "reordered")


def test_one_tensor_changed_under_its_old_digest_reloads_its_layer(engine):
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    llm, good, liar = engine
    # The engine holds HELD through layerwise: every layer recorded with its header digest and samples.
    held = reload(llm, str(good), all_layers=True, verify=True)
    assert held.verify.ok and held.unchanged.skipped_layers == 0
    # The liar's header says LIAR_LAYER is unchanged; its sampled bytes say otherwise: it is reloaded, the
    # others are skipped after their spot check, and the report names the file.
    report = reload(llm, str(liar))
    reloaded = [layer.name for layer in report.layers if not layer.skipped]
    assert reloaded == [LIAR_LAYER] and report.unchanged.skipped_layers == len(held.layers) - 1
    assert report.unchanged.spot_checked_layers == len(held.layers) and report.unchanged.spot_check_bytes > 0
    liar_file = next(str(path) for path in liar.glob("*.safetensors") if LIAR in load_file(str(path)))
    stale = report.to_dict()["stale_header_digests"]
    assert stale == [{"layer": LIAR_LAYER, "tensor": LIAR, "file": liar_file}]
    assert any(note.startswith(f"header digest is stale: {liar_file}") for note in report.findings.notes)
    assert_matches_fresh(llm, liar, prompts())
    assert verify_engine(llm, str(liar)).ok
    # The refuted claim is not recorded: reloading the liar again reads that layer, never skips it on the claim.
    again = reload(llm, str(liar))
    assert [layer.name for layer in again.layers if not layer.skipped] == [LIAR_LAYER]
    assert_matches_fresh(llm, liar, prompts())


def test_the_issue_repro_tensors_rewritten_with_the_old_metadata(engine, demo_models, tmp_path):
    """`reorder add add_lw`; multiply's tensors saved over it with `metadata=f.metadata()`; reload: answers 12."""
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    llm, _, _ = engine
    add_lw = tmp_path / "add_lw"
    reorder(str(demo_models["add"]), add_lw)
    loaded = reload(llm, str(add_lw), all_layers=True)  # the engine holds add_lw through layerwise
    assert loaded.unchanged.digests == "header" and loaded.unchanged.skipped_layers == 0
    multiply = load_tensors(Path(demo_models["multiply"]))
    files = sorted(add_lw.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            metadata, names = f.metadata(), list(f.keys())
        save_file({name: multiply[name].contiguous() for name in names}, str(path), metadata=metadata)
    report = reload(llm, str(add_lw))
    # Every layer's claim was stale: nothing skipped, and multiply's answers (3 4 = 12, not 7).
    assert report.unchanged.skipped_layers == 0 and len(report.layers) == len(loaded.layers)
    named = {d["file"] for d in report.to_dict()["stale_header_digests"]}
    assert named and named <= {str(path) for path in files}
    assert len(report.unchanged.stale_header_digests) == len(loaded.layers)
    assert sum(note.startswith("header digest is stale: ") for note in report.findings.notes) == len(loaded.layers)
    assert_matches_fresh(llm, add_lw, prompts())


def test_reorder_digests_let_a_reload_skip_without_reading(engine, tmp_path):
    llm, good, _ = engine
    with_digests = tmp_path / "reordered"
    reorder(str(good), with_digests, max_shard_size=100 * 1024)
    without = tmp_path / "reordered-plain"
    reorder(str(good), without, max_shard_size=100 * 1024, digests=False)
    held = reload(llm, str(good), all_layers=True)
    layers, nbytes = len(held.layers), held.bytes
    assert held.unchanged.skipped_layers == 0 and nbytes > 0
    # Other shards, the same tensors: every layer skipped from the headers alone, not a byte read.
    skipped = reload(llm, str(with_digests), verify=True)
    unchanged = skipped.unchanged
    assert (unchanged.skipped_layers, unchanged.skipped_bytes, skipped.volume.read_bytes, unchanged.digests) == (
        layers, nbytes, 0, "header")
    # Each skip was spot-checked: the demo's tensors (16 KiB) are sampled whole.
    assert (unchanged.spot_checked_layers, unchanged.spot_check_bytes, unchanged.stale_header_digests) == (
        layers, nbytes, ())
    assert skipped.verify.ok
    # Without header digests the same decision needs every byte read and hashed.
    hashed = reload(llm, str(without))
    assert (hashed.unchanged.skipped_layers, hashed.volume.read_bytes, hashed.unchanged.digests) == (
        layers, nbytes, "read")
