"""Reload only what changed, on a real engine: skips, spot checks, `--all`, and every path that must force a reload.

One engine for the module (started on *multiply*, A), one fresh engine on B (a
checkpoint with every fourth parent layer taken from *add*: 5 of 19 layers
changed), and one restart. Every reload is proven against a fresh engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from layerwise_cli import vllm_compat
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.format.samples import sample_bytes
from layerwise_cli.client.engine.in_process import EngineOptions, call_workers, reload
from layerwise_cli.demo import demo_prompt
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.writer.save import save_checkpoint
from tests.support.engine_support import (
    assert_matches_fresh,
    copy_non_weights,
    fresh_answers,
    load_tensors,
    remember_fresh,
)
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PROMPTS_PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3), (5, 7), (0, 9)]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PROMPTS_PAIRS]


def _write(tensors: dict, folder: Path, like: Path, *, digests: bool, allow_nonfinite: bool = False) -> Path:
    """TENSORS as a checkpoint: `save_checkpoint` (header digests) or one plain safetensors file."""
    if digests:
        save_checkpoint(tensors.items(), folder, max_shard_size=60_000, marker=None, allow_nonfinite=allow_nonfinite)
    else:
        from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    copy_non_weights(like, folder)
    return folder


def _overwrite_with_nan(folder: Path, names: set[str]) -> None:
    """Replace the data bytes of NAMES with NaN bit patterns, leaving every header (and its digests) as it was."""
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = read_shard_header(path)
        with open(path, "r+b") as handle:
            for entry in header.tensors:
                if entry.name in names:
                    handle.seek(8 + header.header_len + entry.begin)
                    handle.write(b"\xc0\x7f" * (entry.nbytes // 2))


@pytest.fixture(scope="module")
def ckpts(demo_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("skip")
    a_dir, add_dir = demo_models["multiply"], demo_models["add"]
    plan = inspect_order(str(a_dir)).plan
    changed = {layer.name for layer in plan.layers[2::4]}  # down, qkv of each layer and lm_head: 5 of 19
    parent = {item.entry.name: item.parent for item in plan.layer_order}
    a, add = load_tensors(a_dir), load_tensors(add_dir)
    b = {name: (add[name] if parent.get(name) in changed else tensor) for name, tensor in a.items()}
    out = {"A": a_dir, "changed": changed, "layers": len(plan.layers),
           "A_d": _write(a, root / "a-digests", a_dir, digests=True),
           "B_d": _write(b, root / "b-digests", a_dir, digests=True),
           "B_plain": _write(b, root / "b-plain", a_dir, digests=False)}
    # B whose unchanged layers hold NaN in the data but A's true digests in the headers: stale header digests
    # (the spot check must see it); loading any of those bytes is refused by the NaN check.
    lying = root / "b-unchanged-unreadable"
    shutil.copytree(out["B_d"], lying)
    _overwrite_with_nan(lying, {name for name, p in parent.items() if p not in changed})
    out["B_unreadable"] = lying
    # A with NaN in the last layer of the stream: the reload fails after every other layer was loaded.
    nan_head = dict(a)
    nan_head["lm_head.weight"] = a["lm_head.weight"].clone()
    nan_head["lm_head.weight"][0, 0] = float("nan")
    out["A_nan_head"] = _write(nan_head, root / "a-nan-head", a_dir, digests=True, allow_nonfinite=True)
    out["bytes"] = {layer.name: layer.bytes for layer in plan.layers}
    out["parent"] = parent
    out["nbytes"] = {item.entry.name: item.entry.nbytes for item in plan.layer_order}
    return out


@pytest.fixture(scope="module")
def fresh_b(ckpts) -> list:
    return fresh_answers(ckpts["B_d"], prompts())


class Engine:
    """The module's engine; `restart` stops it and starts a new one on A (a new worker, here in process)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.llm = None

    def start(self) -> None:
        self.llm = start_here(str(self.model), EngineOptions(max_model_len=64))

    def stop(self) -> None:
        if self.llm is not None:
            stop_here(self.llm)
            self.llm = None

    def engine_ids(self) -> list[str]:
        return [r["engine_id"] for r in call_workers(self.llm, "layerwise_ping")]


@pytest.fixture(scope="module")
def engine(ckpts, fresh_b):
    holder = Engine(ckpts["A"])
    holder.start()
    remember_fresh(holder.llm, ckpts["A"], prompts())
    yield holder
    holder.stop()


def _reload(engine: Engine, source: Path, **kwargs):
    return reload(engine.llm, str(source), **kwargs)


def _skipped(report) -> set[str]:
    return {layer.name for layer in report.layers if layer.skipped}


def _reloaded(report) -> set[str]:
    return {layer.name for layer in report.layers if not layer.skipped}


def _progress_layers(path: Path) -> tuple[int, list[str], set[str]]:
    """The progress file's announced layer count, every layer it marked done, and those marked skipped."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    done = [e for e in events if e["event"] == "layer"]
    return events[0]["layers"], [e["name"] for e in done], {e["name"] for e in done if e.get("skipped")}


def test_header_digests_skip_unchanged_layers_after_a_spot_check(engine, ckpts, tmp_path):
    changed, sizes = ckpts["changed"], ckpts["bytes"]
    first = _reload(engine, ckpts["A_d"], all_layers=True)  # a known start: A, every layer recorded
    assert first.unchanged.skipped_layers == 0 and first.unchanged.all_layers and first.unchanged.digests == "header"
    progress = tmp_path / "progress.jsonl"
    report = _reload(engine, ckpts["B_d"], progress_path=str(progress))
    # The progress bar reaches its total: skipped layers count as done.
    total, done, skipped = _progress_layers(progress)
    assert total == len(done) == len(set(done)) == ckpts["layers"] and skipped == set(_skipped(report))
    assert _reloaded(report) == changed
    assert report.unchanged.skipped_layers == ckpts["layers"] - len(changed) == len(_skipped(report))
    assert all(layer.skipped == "unchanged" for layer in report.layers if layer.name not in changed)
    # Only the changed layers' bytes were streamed; each skipped layer's tensors were only sampled.
    assert report.volume.read_bytes == report.bytes == sum(sizes[name] for name in changed)
    assert report.unchanged.skipped_bytes == sum(sizes.values()) - report.bytes
    skips = report.unchanged
    assert skips.spot_checked_layers == skips.skipped_layers and skips.stale_header_digests == ()
    unchanged = [t for t, layer in ckpts["parent"].items() if layer not in changed]
    assert report.unchanged.spot_check_bytes == sum(sample_bytes(ckpts["nbytes"][t]) for t in unchanged) > 0
    assert report.peak_buffer_bytes == report.memory.predicted_peak_buffer_bytes
    assert report.placement.engine_id == engine.engine_ids()[0]
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    # B's headers over NaN bytes in its unchanged layers: the spot check sees the lie, so those layers are
    # read, their NaN refused, and the engine keeps B.
    with pytest.raises(LayerwiseError) as info:
        _reload(engine, ckpts["B_unreadable"])
    assert "NaN" in str(info.value)
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())


def test_an_identical_checkpoint_skips_everything_and_reads_nothing(engine, ckpts):
    _reload(engine, ckpts["B_d"], all_layers=True)
    report = _reload(engine, ckpts["B_d"])
    assert report.unchanged.skipped_layers == ckpts["layers"] == len(report.layers)
    assert report.volume.read_bytes == report.bytes == report.volume.tensors == 0 and report.peak_buffer_bytes == 0
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    # --all: everything handed over again (and recorded).
    full = _reload(engine, ckpts["B_d"], all_layers=True)
    assert full.unchanged.skipped_layers == 0 and full.volume.read_bytes == full.bytes == sum(ckpts["bytes"].values())
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())


def test_without_header_digests_the_bytes_are_hashed_and_only_changed_layers_load(engine, ckpts, tmp_path):
    _reload(engine, ckpts["B_d"], all_layers=True)
    to_a = _reload(engine, ckpts["A"])  # the demo checkpoint: plain safetensors, no digests
    assert to_a.unchanged.digests == "read" and _reloaded(to_a) == ckpts["changed"]
    assert to_a.volume.read_bytes == sum(ckpts["bytes"].values())  # read to hash, handed over only where changed
    assert to_a.timings.hash_s > 0
    assert_matches_fresh(engine.llm, ckpts["A"], prompts())
    progress = tmp_path / "progress.jsonl"
    to_b = _reload(engine, ckpts["B_plain"], progress_path=str(progress))
    assert _reloaded(to_b) == ckpts["changed"]
    total, done, skipped = _progress_layers(progress)  # skipped after hashing: also counted as done
    assert total == len(done) == len(set(done)) == ckpts["layers"] and skipped == set(_skipped(to_b))
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    # Digests hashed from the bytes equal the header digests: the header copy of B is all skipped. The changed
    # layers were handed over before any hash (their samples showed the change) and hashed afterwards.
    assert to_b.unchanged.hashed_after_handover == len(ckpts["changed"]) and to_b.unchanged.unhashed_layers == 0
    again = _reload(engine, ckpts["B_d"])
    assert again.unchanged.skipped_layers == ckpts["layers"] and again.volume.read_bytes == 0


def test_vllm_own_reload_in_between_forces_the_layers_it_wrote(engine, ckpts):
    _reload(engine, ckpts["B_d"], all_layers=True)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpts["A"])})
    engine.llm.reset_prefix_cache()
    # The records say B; the engine holds A where B differs: those layers must load again.
    report = _reload(engine, ckpts["B_d"])
    assert not (_skipped(report) & ckpts["changed"])
    assert report.unchanged.stale_layers >= len(ckpts["changed"])
    assert any("changed since layerwise loaded them" in note for note in report.findings.notes)
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    assert _reload(engine, ckpts["B_d"]).unchanged.skipped_layers == ckpts["layers"]


def test_a_rollback_leaves_no_record_that_could_skip(engine, ckpts):
    _reload(engine, ckpts["B_d"], all_layers=True)
    with pytest.raises(LayerwiseError) as info:
        _reload(engine, ckpts["A_nan_head"])  # A's layers load, then lm_head is refused: rolled back to B
    assert "rolled back" in str(info.value) and "NaN" in str(info.value)
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    # The rollback loaded B without the NaN check: a checked reload of B skips none of it.
    report = _reload(engine, ckpts["B_d"])
    assert report.unchanged.skipped_layers == 0
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    assert _reload(engine, ckpts["B_d"]).unchanged.skipped_layers == ckpts["layers"]


def test_allow_nonfinite_reloads_record_unchecked_bytes(engine, ckpts):
    _reload(engine, ckpts["B_d"], allow_nonfinite=True, all_layers=True)
    assert _reload(engine, ckpts["B_d"], allow_nonfinite=True).unchanged.skipped_layers == ckpts["layers"]
    assert _reload(engine, ckpts["B_d"]).unchanged.skipped_layers == 0  # the checked reload checks them
    assert _reload(engine, ckpts["B_d"]).unchanged.skipped_layers == ckpts["layers"]


def test_file_order_skips_from_header_digests(engine, ckpts):
    _reload(engine, ckpts["A_d"], all_layers=True)
    report = _reload(engine, ckpts["B_d"], order="file")
    assert _reloaded(report) == ckpts["changed"] and report.placement.order == "file"
    assert report.peak_buffer_bytes == report.memory.predicted_peak_buffer_bytes
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())


def test_a_restarted_engine_has_a_new_id_and_no_record(engine, ckpts):
    before = engine.engine_ids()
    _reload(engine, ckpts["A_d"], all_layers=True)
    engine.stop()
    engine.start()
    after = engine.engine_ids()
    assert after != before and len(after[0]) == 32
    # Started on A, reloaded with A's content: nothing is recorded, so nothing is skipped.
    report = _reload(engine, ckpts["A_d"])
    assert report.unchanged.skipped_layers == 0 and report.placement.engine_id == after[0]
    to_b = _reload(engine, ckpts["B_d"])
    assert _reloaded(to_b) == ckpts["changed"]
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())


def test_layers_vllm_would_rerun_an_unreviewed_hook_on_are_handed_over(engine, ckpts, monkeypatch):
    """vLLM 0.34 reruns every module's own `process_weights_after_loading` after a reload, skipped layers too.

    Emulated on this vLLM (0.32 reruns none), in this process where the engine runs: vLLM is said to rerun
    them, and the MLP class gets a hook layerwise never reviewed. On an identical checkpoint the MLP's layers
    are handed over, every other layer is still skipped, and the report says why.
    """
    client = engine.llm.llm_engine.engine_core
    assert type(client).__name__ == "InprocClient", "this test needs the engine in this process"
    model = client.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
    mlp_class = type(model.model.layers[0].mlp)
    _reload(engine, ckpts["B_d"], all_layers=True)
    monkeypatch.setattr(vllm_compat, "reruns_module_hooks", lambda: True)
    monkeypatch.setattr(mlp_class, "process_weights_after_loading", lambda self: None, raising=False)
    report = _reload(engine, ckpts["B_d"])
    in_mlp = {name for name in ckpts["bytes"] if ".mlp." in name}
    assert in_mlp and _reloaded(report) == in_mlp
    assert _skipped(report) == set(ckpts["bytes"]) - in_mlp
    note = next(note for note in report.findings.notes if "handed over, not skipped" in note)
    assert note.startswith(f"{len(in_mlp)} layer(s)") and "model.layers.0.mlp (" in note
    assert_matches_fresh(engine.llm, ckpts["B_d"], prompts())
    monkeypatch.undo()
    assert _reload(engine, ckpts["B_d"]).unchanged.skipped_layers == ckpts["layers"]
