"""The benchmark's synthetic checkpoints: Qwen3 shapes sized to a target, written in each shard layout."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from layerwise_cli.checkpoint.format.digests import digests_metadata, tensor_digest
from tests.support.synthetic import SyntheticModel, shard_groups, write_safetensors

LAYOUTS = ("in_order", "split_layer", "trainer_export")
LAYOUT_NAMES = {"in_order": "in order", "split_layer": "split across shards", "trainer_export": "trainer export"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def layer_bytes(model: SyntheticModel) -> int:
    """Bytes of one decoder layer."""
    return sum(2 * numel(shape) for name, shape in model.tensors() if ".layers.0." in name)


def numel(shape) -> int:
    """Elements of a tensor of SHAPE."""
    n = 1
    for d in shape:
        n *= d
    return n


def model_for(args, min_vocab: int) -> SyntheticModel:
    """The synthetic model's shapes: a preset, or Qwen3 proportions sized to --size-gib."""
    if args.preset == "qwen3-8b":
        return SyntheticModel(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                              vocab=151936)
    if args.quick:
        base = dict(hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64)
        return SyntheticModel(layers=4, vocab=max(min_vocab, 8192), **base)
    # Qwen3-0.6B's proportions (hidden 1024, intermediate 3072, 16/8 heads) with
    # head_dim 64 (CPU attention needs >= 64); decoder layers take about two
    # thirds of the bytes, embeddings and head the rest, as in small Qwen3s.
    base = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=64)
    target = int(args.size_gib * 2**30)
    per_layer = layer_bytes(SyntheticModel(layers=1, vocab=min_vocab, **base))
    layers = max(16, round(0.65 * target / per_layer))
    rest = target - layers * per_layer - 2 * base["hidden"]
    vocab = max(min_vocab, (rest // (2 * 2 * base["hidden"])) // 64 * 64)
    return SyntheticModel(layers=layers, vocab=vocab, **base)


STAMP = "layerwise-bench.json"


def write_bench_checkpoint(folder: Path, model: SyntheticModel, layout: str, tokenizer: Path, data,
                           shards: int = 4, digests: bool = False, variant: str = "") -> dict:
    """A checkpoint of MODEL in LAYOUT's shard grouping, with real values, an index and a tokenizer.

    With `digests`, every shard header carries `layerwise.digests` (each
    tensor's xxh3-128, as `save_checkpoint` and `reorder` write them). VARIANT
    names what DATA holds beyond the base values (e.g. which layers it
    changed), so that a reused folder is the same checkpoint.

    A folder that already holds the same checkpoint (its stamp, written last,
    matches) is reused: gpu_check.sh runs the benchmark twice on one set.
    """
    stamp = {"model": model.config(), "layout": layout, "shards": shards, "version": 1}
    if digests or variant:
        stamp.update(digests=digests, variant=variant)
    if (folder / STAMP).is_file():
        written = json.loads((folder / STAMP).read_text())
        if written.get("stamp") == stamp:
            return written["checkpoint"]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = dict(model.tensors())
    groups = [g for g in shard_groups(model, layout, shards) if g]
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        # Header and data sorted by name, as safetensors' own writer does.
        metadata = {"format": "pt"}
        if digests:
            metadata.update(digests_metadata({n: tensor_digest(model.dtype, shapes[n], data(n, 2 * numel(shapes[n])))
                                              for n in names}))
        write_safetensors(folder / shard, [(n, model.dtype, shapes[n]) for n in sorted(names)], data, metadata)
        for n in names:
            weight_map[n] = shard
            total += 2 * numel(shapes[n])
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(model.config(), indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, folder / name)
    checkpoint = {"path": str(folder), "layout": layout, "shards": len(groups), "bytes": total,
                  "tensors": len(weight_map), "header_digests": digests}
    (folder / STAMP).write_text(json.dumps({"stamp": stamp, "checkpoint": checkpoint}))
    return checkpoint


def tokenizer_vocab(tokenizer: Path) -> int:
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    return len(data.get("model", {}).get("vocab", {})) + len(data.get("added_tokens", []))


def warm_page_cache(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def default_workdir(needed_bytes: int) -> Path:
    """/dev/shm when it has room (tmpfs pages are page cache: no disk in the way), else the temp dir."""
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.2 * needed_bytes
    base = shm if roomy else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="layerwise-bench-", dir=base))
