"""Sparse deltas on a real engine: A + delta(A->B) equals an engine started fresh on B, and back; refusals.

One engine for the module, started on *multiply* (A); B is an RL-like step
from it (`tests/support/deltas.py`).
Each reload is proven against an engine started fresh on the full step: every
tensor's checksum and the answers.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from layerwise_cli.checkpoint.delta.read import read_delta
from layerwise_cli.client.engine.in_process import EngineOptions, reload
from layerwise_cli.demo import demo_prompt
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.reload.reload_plan import PREPARED_NOTE, PREPARED_REBUILT_NOTE
from tests.support.deltas import rl_step, save_step, write_steps
from tests.support.engine_support import assert_matches_fresh, engine_state, fresh_state
from tests.support.in_process import start_here, stop_here

pytestmark = pytest.mark.engine

PROMPTS_PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3), (5, 7), (0, 9)]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PROMPTS_PAIRS]


@pytest.fixture(scope="module")
def steps(demo_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("delta")
    steps = write_steps(root, demo_models)
    a = steps.pop("tensors")
    nan = dict(a)
    nan["lm_head.weight"] = a["lm_head.weight"].clone()
    nan["lm_head.weight"][0, 0] = float("nan")
    with_nan = save_step(nan, root / "nan_delta", demo_models["multiply"], base=steps["A"], allow_nonfinite=True)
    assert with_nan.delta is not None
    # A back to A against delta(A->B): a chain, rebuilt from A through both patches.
    chained = save_step(a, root / "chained", demo_models["multiply"], base=steps["AB"])
    assert chained.delta is not None, chained.fallback
    # C: B with only its mlp tensors moved again, against delta(A->B): a chain whose other layers the engine
    # holding B keeps (they changed in the first link only).
    from safetensors.torch import load_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    b = {}
    for shard in sorted(steps["B"].glob("*.safetensors")):
        b.update(load_file(shard))
    c = {name: rl_step(t, 0.05, 99) if ".mlp." in name else t for name, t in b.items()}
    assert save_step(c, root / "c_chained", demo_models["multiply"], base=steps["AB"]).delta is not None
    save_step(c, root / "c_full", demo_models["multiply"])
    return {**steps, "NaN": root / "nan_delta", "chained": root / "chained", "C": root / "c_chained",
            "C full": root / "c_full", "root": root}


@pytest.fixture(scope="module")
def fresh(steps) -> None:
    """Engines started fresh on A, B and C, before the engine under test starts: in this process (`start_here`),
    where one started beside it would start with processes of its own (30 s or more)."""
    for name in ("A", "B", "C full"):
        fresh_state(steps[name], prompts())


@pytest.fixture(scope="module")
def llm(steps, fresh):
    engine = start_here(str(steps["A"]), EngineOptions(max_model_len=64))
    yield engine
    stop_here(engine)


def _reload(llm, source: Path, **kwargs):
    return reload(llm, str(source), **kwargs)


def _handed_over(report) -> set[str]:
    return {layer.name for layer in report.layers if not layer.skipped and not layer.patched}


def _changed(report) -> set[str]:
    """The layers handed over or patched in place (`delta_patch`)."""
    return {layer.name for layer in report.layers if not layer.skipped}


def _patched_layers(report, delta_dir: Path) -> set[str]:
    """The engine layers holding a tensor the delta patches (the demo model's names: checkpoint = engine)."""
    patched = read_delta(delta_dir).patches
    names = {layer.name for layer in report.layers}
    found = set()
    for tensor in patched:
        module = tensor.rsplit(".", 1)[0]
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            for part in parts:
                module = module.replace(f".{part}", f".{fused}") if module.endswith(part) else module
        assert module in names, module
        found.add(module)
    return found


def _assert_holds(llm, checkpoint: Path) -> None:
    """Every tensor of the engine byte-equal to an engine started fresh on CHECKPOINT, and its answers."""
    assert engine_state(llm)["checksums"] == fresh_state(checkpoint, prompts())
    assert_matches_fresh(llm, checkpoint, prompts())


def test_an_engine_without_records_is_refused_and_keeps_its_weights(llm, steps):
    with pytest.raises(LayerwiseError) as info:
        _reload(llm, steps["AB"])
    message = str(info.value)
    assert "needs the engine to hold its base" in message and "no layerwise record" in message
    assert "\n" not in message and "rolled back" not in message
    # A fleet's pre-flight refuses it too, but not for `watch`, whose reload rebuilds a delta whatever the engine
    # holds: an RL run's servers, started on its first step, must take a delta step before any reload by layerwise.
    assert not llm.collective_rpc("layerwise_preflight", args=(str(steps["AB"]),))[0]["ok"]
    unchecked = llm.collective_rpc("layerwise_preflight", args=(str(steps["AB"]),), kwargs={"delta_base_check": False})
    assert unchecked[0]["ok"], unchecked
    _assert_holds(llm, steps["A"])


def test_deltas_both_ways_equal_fresh_engines_a_b_a_b(llm, steps):
    _reload(llm, steps["A"], all_layers=True)  # the engine's records now say A
    to_b = _reload(llm, steps["AB"])
    _assert_holds(llm, steps["B"])
    # The layers the delta patches are rebuilt and handed over; a layer it leaves as the base had it (a small
    # norm none of whose values moved) is skipped from the step's digests, after its spot check.
    assert _changed(to_b) == _patched_layers(to_b, steps["AB"]) != set()
    assert to_b.unchanged.spot_checked_layers == to_b.unchanged.skipped_layers
    # What it read: the base's bytes of the layers handed over, and every patch of the delta.
    patches = read_delta(steps["AB"])
    patch_bytes = sum(patches.patch_nbytes(name) for name in patches.patches)
    assert patch_bytes > 0 and to_b.volume.read_bytes == to_b.volume.bytes + patch_bytes
    to_a = _reload(llm, steps["BA"])
    assert _changed(to_a) == _patched_layers(to_a, steps["BA"])
    _assert_holds(llm, steps["A"])
    # --verify proves the engine against the full step the delta rebuilds.
    verified = _reload(llm, steps["AB"], verify=True)
    assert verified.verify is not None and verified.verify.ok, verified.verify
    _assert_holds(llm, steps["B"])
    # The records say the full step B: its full checkpoint is skipped whole, from its header digests.
    again = _reload(llm, steps["B"])
    assert again.unchanged.skipped_layers == len(again.layers) and again.volume.read_bytes == 0
    # Deltas whose base is a delta: the engine holds their base (B). C: the layers only the first link changed
    # are skipped, their spot check sampling the bytes the chain rebuilds (not A's files, which differ).
    to_c = _reload(llm, steps["C"], verify=True)
    assert to_c.verify.ok and to_c.unchanged.skipped_layers > 0 and to_c.unchanged.stale_header_digests == ()
    assert all(".mlp." in name for name in _changed(to_c))
    _reload(llm, steps["B"], all_layers=True)
    # A, rebuilt from A's files through both links.
    _reload(llm, steps["chained"], verify=True)
    _assert_holds(llm, steps["A"])


def test_an_engine_that_missed_a_step_is_brought_to_the_newest_through_the_chain(llm, steps):
    # The engine holds A; C is a delta against B (itself delta(A->B)): it missed B, and C's chain starts at A.
    _reload(llm, steps["A"], all_layers=True)
    caught_up = _reload(llm, steps["C"], verify=True)
    assert caught_up.verify.ok
    _assert_holds(llm, steps["C full"])
    # Every layer either link changed is handed over (the engine held none of B's changes).
    assert _changed(caught_up) == _patched_layers(caught_up, steps["AB"]) | _patched_layers(caught_up, steps["C"])
    # A step outside the chain is still no base: the engine now holds C, and delta(A->B) needs A.
    with pytest.raises(LayerwiseError, match="holds other weights"):
        _reload(llm, steps["AB"])
    _assert_holds(llm, steps["C full"])


def test_the_wrong_base_is_refused_at_preflight(llm, steps):
    _reload(llm, steps["B"], all_layers=True)
    with pytest.raises(LayerwiseError) as info:
        _reload(llm, steps["AB"])  # needs A; the engine holds B
    message = str(info.value)
    assert f"needs the engine to hold its base {steps['A']}" in message and "holds other weights" in message
    assert "rolled back" not in message
    # A fleet pre-flights every server first (`layerwise_preflight`): the same refusal, before any pause.
    answer = llm.collective_rpc("layerwise_preflight", args=(str(steps["AB"]),))[0]
    assert not answer["ok"] and "holds other weights" in answer["error"]
    assert llm.collective_rpc("layerwise_preflight", args=(str(steps["BA"]),))[0]["ok"]
    _assert_holds(llm, steps["B"])


def test_a_local_delta_the_pre_flight_prepared_is_taken_while_its_files_are_unchanged(llm, steps):
    """What a fleet does (pre-flight, then the reload inside the pause): the reload takes the step the pre-flight
    opened, checked and (on the CPU's packed layers) rebuilt, unless a file of its chain was written since."""
    prepared = (PREPARED_NOTE, PREPARED_REBUILT_NOTE)
    _reload(llm, steps["A"], all_layers=True)
    assert llm.collective_rpc("layerwise_preflight", args=(str(steps["AB"]),))[0]["ok"]
    to_b = _reload(llm, steps["AB"])
    assert set(prepared) & set(to_b.findings.notes), to_b.findings.notes
    _assert_holds(llm, steps["B"])
    # Pre-flighted, then the delta's file written again (the same bytes; its change time moves): opened again.
    assert llm.collective_rpc("layerwise_preflight", args=(str(steps["BA"]),))[0]["ok"]
    link = steps["BA"] / "delta.safetensors"
    link.write_bytes(link.read_bytes())
    to_a = _reload(llm, steps["BA"])
    assert not set(prepared) & set(to_a.findings.notes), to_a.findings.notes
    _assert_holds(llm, steps["A"])


def _corrupt_copy(steps, name: str, edit) -> Path:
    out = steps["root"] / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(steps["AB"], out)
    path = out / "delta.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + n]), bytearray(blob[8 + n:])
    edit(header, data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return out


def _sparse_patch(header) -> str:
    """The first tensor a (v2) delta's header patches sparsely."""
    meta = json.loads(header["__metadata__"]["layerwise.delta"])
    return sorted(n for n, spec in meta["tensors"].items() if spec["kind"] == "sparse")[0]


def test_a_corrupt_delta_is_refused_and_the_engine_keeps_its_weights(llm, steps):
    """A chunk that decodes to another count than its header's, a truncated chunk, a truncated file: refused at
    pre-flight, one line naming the file and the tensor, before the engine changes."""
    _reload(llm, steps["A"], all_layers=True)

    def one_more(header, data):
        meta = json.loads(header["__metadata__"]["layerwise.delta"])
        spec = meta["tensors"][_sparse_patch(header)]
        spec["chunks"][0][1] += 1
        spec["changed"] += 1
        header["__metadata__"]["layerwise.delta"] = json.dumps(meta)

    def cut(header, data):
        entry = header[_sparse_patch(header) + "::diffs.0"]
        begin, end = entry["data_offsets"]
        del data[end - 3:end]
        entry["data_offsets"], entry["shape"] = [begin, end - 3], [end - 3 - begin]
        for key, value in header.items():
            if key != "__metadata__" and value["data_offsets"][0] >= end:
                value["data_offsets"] = [o - 3 for o in value["data_offsets"]]

    for name, edit, what in (("another_count", one_more, "its header says"), ("cut_chunk", cut, "truncated")):
        bad = _corrupt_copy(steps, name, edit)
        with pytest.raises(LayerwiseError) as info:
            _reload(llm, bad)
        message = str(info.value)
        assert what in message and str(bad) in message and "chunk 0" in message and "\n" not in message
        assert "rolled back" not in message
    truncated = steps["root"] / "truncated"
    shutil.copytree(steps["AB"], truncated)
    path = truncated / "delta.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LayerwiseError, match="truncated"):
        _reload(llm, truncated)
    _assert_holds(llm, steps["A"])


def test_nan_in_the_new_values_is_refused(llm, steps):
    _reload(llm, steps["A"], all_layers=True)
    with pytest.raises(LayerwiseError) as info:
        _reload(llm, steps["NaN"])
    # A v2 delta stores differences from the base: the new value is known, and refused, as it is rebuilt (the
    # reload is then rolled back to what the engine held).
    assert "lm_head.weight" in str(info.value) and "NaN" in str(info.value)
    _assert_holds(llm, steps["A"])


def test_a_base_changed_on_disk_is_caught_by_its_digests(llm, steps):
    _reload(llm, steps["A"], all_layers=True)
    moved = steps["root"] / "moved"
    shutil.copytree(steps["root"], moved, ignore=shutil.ignore_patterns("moved"))
    base = moved / "step_1"
    shard = sorted(base.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01  # its bytes change, its header digest does not
    shard.write_bytes(bytes(data))
    # The delta names step_1 by its absolute path, which still exists: point it at the damaged copy.
    delta = moved / "step_2"
    shutil.rmtree(steps["root"] / "moved" / "b_full")

    def rebase(header, blob):
        meta = json.loads(header["__metadata__"]["layerwise.delta"])
        meta["base"]["location"] = str(base)
        header["__metadata__"]["layerwise.delta"] = json.dumps(meta)

    rebased = _corrupt_copy({"root": moved, "AB": delta}, "rebased", rebase)
    with pytest.raises(LayerwiseError) as info:
        _reload(llm, rebased)
    assert "is not the delta's base" in str(info.value) or "not what layer" in str(info.value)
    _assert_holds(llm, steps["A"])


def test_a_corrupt_stream_rolls_back_to_the_exact_step_held(llm, steps):
    """A delta whose compressed stream was altered (its frame still whole): caught by its checksum as it is
    decoded, mid-stream, and rolled back.

    The engine held B through a delta (what it holds is that delta): the rollback rebuilds B from A plus the
    patch, whatever the engine holds by then, proved by the same digests.
    """
    _reload(llm, steps["A"], all_layers=True)
    _reload(llm, steps["AB"])

    def alter_a_byte(header, data):
        # The largest frame: a byte in its last block, before its checksum, leaves its header whole.
        begin, end = max((value["data_offsets"] for key, value in header.items() if key.endswith("::diffs.0")),
                         key=lambda offsets: offsets[1] - offsets[0])
        assert end - begin >= 16  # magic, frame and block headers, content, checksum: byte -5 is content
        data[end - 5] ^= 0xFF

    bad = _corrupt_copy({"root": steps["root"], "AB": steps["BA"]}, "altered", alter_a_byte)
    with pytest.raises(LayerwiseError) as info:
        _reload(llm, bad)
    message = str(info.value)
    assert "stream is corrupt" in message and "rolled back" in message and str(bad) in message
    _assert_holds(llm, steps["B"])

