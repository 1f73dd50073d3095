"""`benchmarks/device_check.py` (the lent GPU machine's check) runs here with the device mapped to CPU.

The same core runs on the GPU through `scripts/device_check.sh`; this keeps it
from rotting between lent machines: every variant runs, every tensor is
checked against its header digest, the writer comparison runs, and the
report carries the fields the docs and the targets read. vLLM is made
unimportable in the child process: the lent machine has none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_checkpoints import model_for, write_bench_checkpoint
from benchmarks.device_check import DATA_VARIANT, LATER_LAYOUT_VARIANTS, stamped_weights
from benchmarks.device_variants import LAYERWISE, VARIANTS
from layerwise_cli.checkpoint.format.header import read_shard_header

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# The child runs the core with `vllm` unimportable (None in sys.modules makes any import of it fail).
NO_VLLM = ("import runpy, sys; sys.modules['vllm'] = None; "
           "runpy.run_module('benchmarks.device_check', run_name='__main__')")


def run_check(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    command = [sys.executable, "-c", NO_VLLM, "--device", "cpu", "--preset", "quick", "--runs", "1",
               "--workdir", str(tmp_path / "work"), "--keep", "--out", str(out), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    report = json.loads((out / "device_check.json").read_text()) if (out / "device_check.json").is_file() else {}
    return done, report


def test_the_cpu_path_checks_every_byte_and_writes_the_report(tmp_path):
    done, report = run_check(tmp_path, "--layouts", "in_order,trainer_export")
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["ok"] is True and report["skipped"] == []
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch_threads"] == 1
    assert "targets:" in done.stdout and (tmp_path / "out" / "device_check.txt").read_text().strip()

    model_bytes = report["checkpoint_model"]["bytes"]
    assert [r["layout"] for r in report["layouts"]] == ["in_order", "trainer_export"]
    for result, variants in zip(report["layouts"], (VARIANTS, LATER_LAYOUT_VARIANTS), strict=True):
        assert result["bytes"] == model_bytes and result["runs"] == 1
        assert set(result["warm"]) == set(variants)
        layerwise = [v for v in variants if v in LAYERWISE]
        for variant, figures in result["warm"].items():
            assert figures["median_s"] > 0 and len(figures["samples_s"]) == 1, variant
            if variant != "page_cache_read":  # that one reads whole files, headers too
                assert figures["delivered_bytes"] == model_bytes, variant
        # Every layerwise variant checked every tensor against the header digests.
        assert set(result["bit_exact"]) == set(layerwise)
        for variant, check in result["bit_exact"].items():
            assert check["ok"] and check["verified"] == check["tensors"] == result["tensors"], variant
        stream = result["warm"]["layerwise"]["stream"]
        assert stream["read_bytes"] == model_bytes and stream["check_s"] > 0
        bounds = result["memory_bounds"]
        assert bounds["largest_layer_bytes"] < bounds["largest_two_consecutive_layers_bytes"] <= model_bytes
        assert set(result["memory"]) == set(layerwise) and all(m["ok"] for m in result["memory"].values())
        assert result["memory"]["layerwise_no_readahead"]["bound_bytes"] == bounds["largest_layer_bytes"]
    first = report["layouts"][0]
    assert first["warm"]["layerwise_no_check"]["stream"]["check_s"] == 0
    assert first["warm"]["layerwise_hash"]["stream"]["hash_s"] > 0
    parts = first["time"]
    for key in ("read_s", "staging_copy_s", "transfer_s", "check_s", "hash_s", "readahead_saves_s"):
        assert isinstance(parts[key], float), key

    cold = first["cold"]
    assert cold["status"] == "ran" or cold["status"].startswith("not possible"), cold
    if cold["status"] == "ran":
        assert set(cold["variants"]) == {"page_cache_read", "layerwise", "load_file", "safe_open_vllm_order"}
        assert all(v["resident_before_bytes"] is None or v["resident_before_bytes"] <= 0.05 * model_bytes
                   for v in cold["variants"].values())

    writer = report["writer"]
    assert writer["ran"] and writer["identical"] and writer["digests_match_source"], writer
    assert writer["tensors"] == first["tensors"] and len([f for f in writer["files"] if f.endswith(".safetensors")]) > 1

    targets = report["targets"]
    assert len(targets) == 8
    for target in targets:
        assert target["layout"] in ("in_order", "trainer_export") and isinstance(target["met"], bool)
    speed = [t for t in targets if t["threshold"] in (0.9, 1.2)]
    assert len(speed) == 4 and all(t["ratio"] > 0 for t in speed)
    assert all(t["met"] for t in targets if "bit-exact" in t["target"])


def test_a_changed_byte_fails_the_check_and_names_the_tensor(tmp_path):
    # The checkpoint the run will reuse (same stamp), with one byte of one tensor changed after its digest was taken.
    model = model_for(argparse.Namespace(preset=None, quick=True, size_gib=None), 0)
    folder = tmp_path / "work" / "in_order"
    write_bench_checkpoint(folder, model, "in_order", tmp_path / "no-tokenizer", stamped_weights(model),
                           shards=4, digests=True, variant=DATA_VARIANT)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = next(p for p in sorted(folder.glob("*.safetensors"))
                 if name in {t.name for t in read_shard_header(p)[0].tensors})
    header, _ = read_shard_header(shard)
    entry = next(t for t in header.tensors if t.name == name)
    at = header.data_start + entry.begin + 100  # a low mantissa byte: the value stays finite
    data = bytearray(shard.read_bytes())
    data[at] ^= 1
    shard.write_bytes(bytes(data))

    done, report = run_check(tmp_path, "--layouts", "in_order", "--cold", "off")
    assert done.returncode == 1, done.stderr[-3000:]
    assert report["ok"] is False
    checks = report["layouts"][0]["bit_exact"]
    for variant, check in checks.items():
        assert not check["ok"] and any(m.startswith(name) for m in check["mismatches"]), variant
    assert any("stream's hash" in m for m in checks["layerwise_hash"]["mismatches"])
    assert not next(t for t in report["targets"] if "bit-exact" in t["target"])["met"]
