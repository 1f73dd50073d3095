"""A header digest that lies: the skip trusts headers, `--verify` and the scans do not.

A layer whose header digest equals the one the engine recorded is skipped
without reading a byte (that is the point of header digests). So a shard whose
header claims the old digest over new bytes makes the reload keep the old
layer; what catches it is `reload(..., verify=True)` (`layerwise reload
--verify`), which compares every live layer with the checkpoint's bytes, and
`inspect-order --scan` / `reorder`, which hash the bytes against the headers.
And the honest case: `reorder`'s header digests let a reload skip every
unchanged layer without reading it. One engine (the demo `multiply` model),
started once for the module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.engine_support import load_tensors

pytestmark = pytest.mark.engine

LIAR = "model.layers.0.mlp.down_proj.weight"  # its bytes change, its header digest does not
LIAR_LAYER = "model.layers.0.mlp.down_proj"


def _save(tensors: dict, folder: Path, model_dir: Path) -> Path:
    from layerwise_cli import save_checkpoint

    config = json.loads((model_dir / "config.json").read_text())
    save_checkpoint(iter(sorted(tensors.items())), folder, config=config, max_shard_size=64 * 1024, marker=None)
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(path, folder / path.name)
    return folder


def _lie(good: Path, liar: Path, new_bytes: bytes) -> Path:
    """A copy of GOOD whose LIAR tensor holds NEW_BYTES, every header (its digests) left as it was."""
    from layerwise_cli.checkpoint.header import read_shard_header

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
    import torch

    from layerwise_cli.client.local import EngineOptions, start_engine, stop_engine

    root = tmp_path_factory.mktemp("lying-digest")
    a, b = Path(demo_models["multiply"]), Path(demo_models["add"])
    tensors_a, tensors_b = load_tensors(a), load_tensors(b)
    assert not torch.equal(tensors_a[LIAR], tensors_b[LIAR])
    good = _save(tensors_a, root / "good", a)
    liar = _lie(good, root / "liar", tensors_b[LIAR].contiguous().view(torch.uint8).numpy().tobytes())
    llm = start_engine(str(a), EngineOptions(max_model_len=64))
    try:
        yield llm, good, liar
    finally:
        stop_engine(llm)


def test_the_scans_catch_the_lie(engine):
    from layerwise_cli.checkpoint.finite import scan_checkpoint
    from layerwise_cli.checkpoint.sources import open_checkpoint
    from layerwise_cli.errors import LayerwiseError
    from layerwise_cli.reorder.rewrite import reorder

    _, good, liar = engine
    assert scan_checkpoint(open_checkpoint(str(good))).digest_mismatches == ()
    found = scan_checkpoint(open_checkpoint(str(liar))).digest_mismatches
    assert [m.name for m in found] == [LIAR]
    with pytest.raises(LayerwiseError, match=f"tensor {LIAR}: its bytes do not match"):
        reorder(str(liar), liar.parent / "reordered")


def test_verify_catches_a_layer_skipped_on_a_lying_digest(engine):
    from layerwise_cli.client.local import reload, verify_engine
    from layerwise_cli.errors import LayerwiseError

    llm, good, liar = engine
    # The engine holds GOOD through layerwise: every layer recorded with its header digest.
    held = reload(llm, str(good), all_layers=True, verify=True)
    assert held.verify.ok and held.skipped_layers == 0
    # The liar's header says LIAR_LAYER is unchanged: it is skipped, nothing read for it, and --verify,
    # which compares the live layer with the liar's bytes, names it.
    with pytest.raises(LayerwiseError, match=LIAR_LAYER) as caught:
        reload(llm, str(liar), verify=True)
    assert "differ" in str(caught.value) or "mismatch" in str(caught.value)
    result = verify_engine(llm, str(liar))
    assert not result.ok and list(result.mismatched) == [LIAR_LAYER]
    # Against the checkpoint it was made from, the engine still matches: the skip kept the old layer.
    assert verify_engine(llm, str(good)).ok
    # --all reads every byte and loads the liar's true contents.
    forced = reload(llm, str(liar), all_layers=True, verify=True)
    assert forced.verify.ok and forced.skipped_layers == 0


def test_reorder_digests_let_a_reload_skip_without_reading(engine, tmp_path):
    from layerwise_cli.client.local import reload
    from layerwise_cli.reorder.rewrite import reorder

    llm, good, _ = engine
    with_digests = tmp_path / "reordered"
    reorder(str(good), with_digests, max_shard_size=100 * 1024)
    without = tmp_path / "reordered-plain"
    reorder(str(good), without, max_shard_size=100 * 1024, digests=False)
    held = reload(llm, str(good), all_layers=True)
    layers, nbytes = len(held.layers), held.bytes
    assert held.skipped_layers == 0 and nbytes > 0
    # Other shards, the same tensors: every layer skipped from the headers alone, not a byte read.
    skipped = reload(llm, str(with_digests), verify=True)
    assert (skipped.skipped_layers, skipped.skipped_bytes, skipped.read_bytes, skipped.digests) == (
        layers, nbytes, 0, "header")
    assert skipped.verify.ok
    # Without header digests the same decision needs every byte read and hashed.
    hashed = reload(llm, str(without))
    assert (hashed.skipped_layers, hashed.read_bytes, hashed.digests) == (layers, nbytes, "read")
