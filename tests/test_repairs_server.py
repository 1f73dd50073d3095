"""`layerwise reload --url ... --verify` against real servers, with the repairs after vLLM's reload off and on.

One `layerwise serve` server per family, started on B (so that its fingerprints as started are a fresh
engine's on B), then reloaded to A. With `LAYERWISE_NO_REPAIRS=1` in the CLI's environment (the client
asks the workers for a reload without repairs), `--verify` must exit 1 naming exactly what vLLM's reload
leaves stale on this CPU (and pass where its kernels leave nothing stale); without it, `--verify` passes
with nothing unchecked, the JSON report names every tensor refreshed, and the server's fingerprints (every
tensor and buffer, kernels read back) equal the fresh ones.
The same two checks run in process in the equivalence matrix (`test_verify_names_what_the_repairs_fix...`),
with answers compared to a fresh engine.
"""

from __future__ import annotations

import json

import pytest

from layerwise_cli.client.servers.reload_servers import server_fingerprints
from tests.support.cpu_kernels import left_stale_by_vllm, on_cpu, verify_name
from tests.support.producers import Producer, save_pretrained_checkpoint
from tests.support.server_support import RunningServer, run_cli

pytestmark = pytest.mark.engine

# Family -> (producer, what vLLM's reload can leave stale: verify's names, and the report's (module, tensor)).
# Which of them it leaves stale depends on the CPU's kernels (`left_stale_by_vllm`).
FAMILIES = {
    "nemotron_h": (Producer("nemotron_h", max_shard_size="96KB"), ("model.layers.0.mixer.conv_weights",),
                   {("model.layers.0.mixer", "conv_weights")}),
    "qwen3-tied": (Producer("qwen3", tied=True, max_shard_size="96KB"), ("lm_head",), {("lm_head", "cpu_linear")}),
    "qwen3_moe": (Producer("qwen3_moe", max_shard_size="96KB"),
                  ("model.layers.0.mlp.experts.routed_experts", "model.layers.1.mlp.experts.routed_experts"),
                  {(f"model.layers.{i}.mlp.experts.routed_experts", p)
                   for i in (0, 1) for p in ("w13_weight", "w2_weight")}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """A server started fresh on B, its fingerprints recorded, then reloaded (repairs on) to A."""
    producer, names, refreshed = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    a = save_pretrained_checkpoint(root / "a", producer, seed=1)
    b = save_pretrained_checkpoint(root / "b", producer, seed=2)
    with RunningServer(b, start_timeout=600) as server:
        fresh = server_fingerprints(server.url)
        done = run_cli("reload", "--weights-path", str(a), "--url", server.url)
        assert done.returncode == 0, done.stderr[-3000:]
        assert server_fingerprints(server.url) != fresh
        stale = left_stale_by_vllm(names, b)
        yield {"server": server, "a": a, "b": b, "fresh": fresh, "names": names, "refreshed": refreshed,
               "stale": stale}


def test_verify_with_the_repairs_off_names_what_vllm_leaves_stale(family):
    if not on_cpu():
        pytest.skip("nothing is left stale on a GPU (no repack after loading): the repairs do nothing there")
    # --allow-unchecked: a buffer left stale would fail the reload before --verify could name it.
    proc = run_cli("reload", "--weights-path", str(family["b"]), "--url", family["server"].url, "--verify",
                   "--allow-unchecked", env={"LAYERWISE_NO_REPAIRS": "1", "COLUMNS": "250"})
    assert "CPU repairs are off" in proc.stdout
    names = family["stale"]
    if not names:
        # This CPU's kernels follow the weights in place (no packed copy): nothing is stale to name.
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "verified" in proc.stderr and "differs:" not in proc.stdout
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{len(names)} layer(s) differ from what the source must produce: {', '.join(names)}" in errors[0]
    for name in names:
        assert f"differs: {name}:" in proc.stdout, proc.stdout
    assert "not checked" not in proc.stdout


def test_verify_with_the_repairs_on_passes_and_the_server_holds_a_fresh_engines_state(family):
    # --all: the records would skip every layer (the engine holds B's bytes, repaired or not).
    proc = run_cli("reload", "--weights-path", str(family["b"]), "--url", family["server"].url, "--verify", "--all",
                   "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (server,) = json.loads(proc.stdout)["servers"]
    verify = server["verify"]
    assert verify["ok"] and not verify["skipped"] and not verify["errors"] and not verify["unchecked_accepted"]
    assert verify["checked"] == verify["matched"] > 0
    refreshed = {(entry["module"], entry["tensor"]) for entry in server["report"]["refreshed"]}
    # Everything stale is refreshed; a kernel rebuilt where it was not stale (the tied head) is harmless.
    stale = {(module, tensor) for module, tensor in family["refreshed"]
             if verify_name(module, tensor) in family["stale"]}
    assert stale <= refreshed <= (family["refreshed"] if on_cpu() else set())
    assert all(entry["reason"] for entry in server["report"]["refreshed"])
    assert server_fingerprints(family["server"].url) == family["fresh"]
