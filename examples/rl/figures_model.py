"""The figures' model: a Qwen3 of the reload benchmark's shape (`benchmarks.bench_checkpoints.model_for`), with
normal weights (std 0.02) and the demo's tokenizer, written once in layer order."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.bench_checkpoints import model_for, tokenizer_vocab, write_bench_checkpoint
from layerwise_cli.demo import demo_checkpoint
from tests.support.synthetic import normal_weights

# The benchmark's default is 1 GiB; the issue asks for at least 0.4 GB. Each step AdamW updates every value.
SIZE_GIB = 0.4


def figures_checkpoint(folder: Path, size_gib: float = SIZE_GIB) -> Path:
    """FOLDER holding the model (written unless it is there already, `write_bench_checkpoint`'s stamp)."""
    tokenizer = demo_checkpoint("multiply")
    args = argparse.Namespace(preset="auto", quick=False, size_gib=size_gib)
    model = model_for(args, tokenizer_vocab(tokenizer))
    write_bench_checkpoint(folder, model, "in_order", tokenizer, normal_weights(model), shards=4, digests=True)
    return folder
