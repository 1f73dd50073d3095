"""`save_checkpoint` with real parts: a `transformers` model's state dict, shuffled, loads in a real vLLM engine.

The model is the equivalence matrix's Qwen3 B (`save_pretrained`, seed 2):
`transformers` loads it and its `state_dict()` is handed to `save_pretrained`'s
rival, `save_checkpoint`, in shuffled order with a small `max_shard_size`. The
fresh-engine reference on the `save_pretrained` checkpoint is the shared one
(`fresh_answers`, keyed by content): in a session that ran the matrix it costs
no engine start, and this module adds one engine, started on the written
checkpoint.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from layerwise_cli import save_checkpoint
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import (
    PAIR_PROMPTS,
    differing_prompts,
    engine_options,
    fresh_answers,
    greedy_with_logprobs,
    load_tensors,
)
from tests.support.in_process import start_here, stop_here
from tests.support.producers import Producer, save_pretrained_checkpoint

pytestmark = pytest.mark.engine

MAX_SHARD_SIZE = 20_000  # bytes: the 64-wide Qwen3's 16 KiB layers get shards of their own, or share two by two


@dataclass
class Written:
    original: Path  # save_pretrained's checkpoint
    state_dict: dict
    written: Path  # save_checkpoint's
    saved: object  # the SavedCheckpoint
    fresh: list  # answers of an engine started fresh on `original`
    answers: list  # answers of an engine started on `written`


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Written:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    import transformers  # noqa: PLC0415 - transformers: heavy (test collection stays fast)

    root = tmp_path_factory.mktemp("writer-engine")
    original = save_pretrained_checkpoint(root / "b", Producer("qwen3", max_shard_size="40KB"), seed=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.bfloat16)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    items = list(model.state_dict().items())
    random.Random(14).shuffle(items)
    written = root / "run" / "step_1"
    saved = save_checkpoint(iter(items), written, config=model.config, max_shard_size=MAX_SHARD_SIZE)
    del model, items
    for path in original.iterdir():  # the tokenizer, which a trainer copies once per run
        if path.name.startswith("tokenizer") or path.name in {"special_tokens_map.json", "vocab.json"}:
            shutil.copy2(path, written / path.name)
    fresh = fresh_answers(original, PAIR_PROMPTS, engine_options())
    llm = start_here(str(written), engine_options())
    try:
        answers = greedy_with_logprobs(llm, PAIR_PROMPTS)
    finally:
        stop_here(llm)
    return Written(original, state_dict, written, saved, fresh, answers)


def test_written_tensors_equal_the_state_dict(run):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    got = load_tensors(run.written)
    assert set(got) == set(run.state_dict) == set(load_tensors(run.original))
    for name, tensor in run.state_dict.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert len(run.saved.shards) >= 10


def test_inspect_order_predicts_one_largest_layer(run):
    ours = inspect_order(str(run.written))
    assert ours.plan.mapping.kind == "table"
    assert ours.file_order_buffering.peak_buffer_bytes == ours.plan.largest_layer_bytes == run.saved.peak_buffer_bytes
    assert ours.digest_shards == len(run.saved.shards)
    assert inspect_order(str(run.original)).plan.largest_layer_bytes == ours.plan.largest_layer_bytes


def test_engine_on_the_written_checkpoint_answers_as_on_save_pretrained(run):
    assert len(PAIR_PROMPTS) >= 8
    differ = differing_prompts(run.answers, run.fresh, exact=True)
    assert not differ, f"{len(differ)} of {len(PAIR_PROMPTS)} prompts differ, first {PAIR_PROMPTS[differ[0]]!r}"
    assert (run.written / "STABLE").exists()
