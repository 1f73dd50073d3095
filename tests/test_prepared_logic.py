"""What a pre-flight prepares for the reload inside a server's pause (`worker/state/prepared.py`): a pinned step
kept once, and a delta step rebuilt once into a full step's files (`checkpoint/delta/rebuilt_step.py`)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from layerwise_cli import save_checkpoint
from layerwise_cli.checkpoint.delta import rebuilt_step
from layerwise_cli.checkpoint.delta.rebuilt_step import write_rebuilt_step
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.format.digests import checkpoint_digests
from layerwise_cli.checkpoint.local_pin import files_pin
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.state import prepared
from layerwise_cli.worker.state.prepared import Prepared, prepared_folder, step_files
from tests.support.deltas import changed_copy, small_state_dict, stored_bytes


@pytest.fixture
def chain(tmp_path):
    """step_1 full, step_2 and step_3 deltas (each from the one before), and step_3 in full."""
    tensors = small_state_dict(torch.bfloat16)
    save_checkpoint(tensors.items(), tmp_path / "run" / "step_1", max_shard_size=3000)
    for i in (2, 3):
        tensors = {name: changed_copy(t, 0.02 if t.numel() > 100 else 0.3, i) for name, t in tensors.items()}
        saved = save_checkpoint(tensors.items(), tmp_path / "run" / f"step_{i}",
                                base=tmp_path / "run" / f"step_{i - 1}")
        assert saved.delta is not None, saved.fallback
    save_checkpoint(tensors.items(), tmp_path / "full_3")
    return tmp_path


def test_a_rebuilt_step_is_the_full_step_in_its_base_s_layout_with_the_step_s_digests(chain):
    step = open_step(str(chain / "run" / "step_3"))
    assert step.delta is not None and len(step.delta.links) == 2
    rebuilt = write_rebuilt_step(step, chain / "prepared" / "step")
    assert rebuilt.delta is None and rebuilt.local_dir == chain / "prepared" / "step"
    assert rebuilt.source == step.source and rebuilt.kind == step.kind
    assert [s.name for s in rebuilt.shards] == [s.name for s in step.shards] and len(rebuilt.shards) > 1
    assert checkpoint_digests(rebuilt.shards) == step.delta.step_digests
    got, want = stored_bytes(chain / "prepared" / "step"), stored_bytes(chain / "full_3")
    assert got.keys() == want.keys() and all((got[name] == want[name]).all() for name in want)
    # Another tool reads it as the full step it is (an index, each shard's header).
    index = json.loads((chain / "prepared" / "step" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert open_checkpoint(str(chain / "prepared" / "step")).total_bytes == step.total_bytes


def test_a_link_that_does_not_rebuild_its_step_leaves_the_folder_as_it_was(chain):
    folder = chain / "prepared" / "step"
    write_rebuilt_step(open_step(str(chain / "run" / "step_2")), folder)
    before = stored_bytes(folder)
    step = open_step(str(chain / "run" / "step_3"))
    # The base's bytes change under the chain after it was opened: the rebuilt tensor is not the step's.
    shard = next(iter(sorted((chain / "run" / "step_1").glob("*.safetensors"))))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(LayerwiseError) as refused:
        write_rebuilt_step(step, folder)
    assert "step_1" in str(refused.value) or "model-" in str(refused.value)
    after = stored_bytes(folder)
    assert after.keys() == before.keys() and all((after[n] == before[n]).all() for n in before)
    assert not folder.with_name("step" + rebuilt_step._PARTIAL).exists()


def test_a_rebuilt_nan_is_refused_before_any_pause_naming_the_step_and_tensor(chain):
    tensors = small_state_dict(torch.bfloat16)
    broken = dict(tensors)
    weight = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    weight[3, 5] = float("nan")  # one value of a large tensor: a sparse patch, differences and no values
    broken["model.layers.1.mlp.down_proj.weight"] = weight
    save_checkpoint(tensors.items(), chain / "nan_run" / "step_1")
    saved = save_checkpoint(broken.items(), chain / "nan_run" / "step_2", base=chain / "nan_run" / "step_1",
                            allow_nonfinite=True)
    assert saved.delta is not None
    step = open_step(str(chain / "nan_run" / "step_2"))
    with pytest.raises(LayerwiseError) as refused:
        write_rebuilt_step(step, chain / "prepared" / "step")
    message = str(refused.value)
    assert "nan_run/step_2" in message and "model.layers.1.mlp.down_proj.weight has 1 NaN" in message
    assert not (chain / "prepared" / "step").exists()
    # A reload that loads NaN anyway (--allow-nonfinite) gets the step prepared as it is.
    assert write_rebuilt_step(step, chain / "prepared" / "step", check_finite=False).delta is None


def test_a_full_step_is_not_rebuilt(chain):
    with pytest.raises(LayerwiseError, match="not a delta step"):
        write_rebuilt_step(open_step(str(chain / "run" / "step_1")), chain / "prepared" / "step")


def test_a_kept_step_is_taken_once_at_its_pin_and_only_while_fresh(chain, monkeypatch):
    step = open_step(str(chain / "run" / "step_3"))
    kept = Prepared()
    kept.keep("s3://b/run/step_3", None, step)  # no pin: nothing names the bytes, nothing is kept
    assert kept.take("s3://b/run/step_3", None) is None
    kept.keep("s3://b/run/step_3", "etags:1", step)
    assert kept.take("s3://b/run/step_3", "etags:2") is None  # another pin
    assert kept.take("s3://b/run/step_3", "etags:1") is None  # the mismatch took it
    kept.keep("s3://b/run/step_3", "etags:1", step, ("a note",))
    assert kept.take("s3://b/run/step_3", "etags:1") == (step, ("a note",))
    assert kept.take("s3://b/run/step_3", "etags:1") is None  # once
    kept.keep("s3://b/run/step_3", "etags:1", step)
    clock = iter([0.0])
    monkeypatch.setattr(prepared.time, "monotonic", lambda: next(clock, prepared.KEEP_S + 1.0))
    kept.keep("s3://b/run/step_3", "etags:1", step)
    assert kept.take("s3://b/run/step_3", "etags:1") is None  # older than KEEP_S


def test_a_checked_chain_is_not_decoded_again(chain, monkeypatch):
    step = open_step(str(chain / "run" / "step_3"))
    step.delta.validate()
    step.delta.refuse_nonfinite()
    calls = []
    link_type = type(step.delta.links[0])
    monkeypatch.setattr(link_type, "validate", lambda self: calls.append("validate"))
    monkeypatch.setattr(link_type, "refuse_nonfinite", lambda self: calls.append("refuse_nonfinite"))
    step.delta.validate()
    step.delta.refuse_nonfinite()
    assert calls == []
    fresh = open_step(str(chain / "run" / "step_3")).delta
    fresh.validate()
    assert calls == ["validate", "validate"]  # each opening checks anew, every link


def test_a_local_step_is_taken_once_while_its_files_keep_their_pin(chain):
    step = open_step(str(chain / "run" / "step_3"))
    files = tuple(step_files(step))
    names = {path.name for path in files}
    # Both links' delta files, and the full step's shards and index at the chain's start.
    assert [p.parent.name for p in files if p.name == "delta.safetensors"] == ["step_2", "step_3"]
    assert "model.safetensors.index.json" in names and len([p for p in files if p.parent.name == "step_1"]) > 2
    kept = Prepared()
    kept.keep(step.source, files_pin(files), step, ("a note",), files)
    assert kept.take_local(step.source) == (step, ("a note",))
    assert kept.take_local(step.source) is None  # once
    # The next reload takes it or ends it: a reload of another step in between leaves nothing for this one.
    kept.keep(step.source, files_pin(files), step, (), files)
    assert kept.take_local(str(chain / "run" / "step_2")) is None
    assert kept.take_local(step.source) is None
    # A link written after the pre-flight (its bytes as they were, its change time not): opened again.
    kept.keep(step.source, files_pin(files), step, (), files)
    link = chain / "run" / "step_2" / "delta.safetensors"
    time.sleep(0.05)
    link.write_bytes(link.read_bytes())
    assert kept.take_local(step.source) is None


def test_a_dead_process_s_prepared_folder_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path))
    dead = tmp_path / "prepared" / "999999999" / "step"
    dead.mkdir(parents=True)
    mine = prepared_folder()
    assert not dead.parent.exists() and mine.parent.name.isdigit() and mine.name == "step"
