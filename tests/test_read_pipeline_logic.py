"""A reload's reading side, without an engine: read order, read-ahead, shared check, early fingerprints, plan cache."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import layerwise_cli.worker.stream.layer_reader as layer_module
import layerwise_cli.worker.stream.read_ahead as stream_module
from layerwise_cli.checkpoint.format.finite import first_nonfinite, first_nonfinite_shared
from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.engine_cpus import bound_worker_cpus
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.plan import PlannedTensor, simulate_buffering
from layerwise_cli.worker.proof.early_fingerprints import EarlyFingerprints
from layerwise_cli.worker.state.layer_state import layer_fingerprints, layer_fingerprints_parallel
from layerwise_cli.worker.state.plan_cache import PlanCache, structure_key
from layerwise_cli.worker.stream.read_ahead import open_stream, read_in_order
from layerwise_cli.worker.stream.read_order import pipelined_order
from layerwise_cli.worker.stream.stats import ReadAheadStats
from layerwise_cli.writer.save import save_checkpoint
from tests.support.small_qwen3 import CONFIG, qwen3_like


def _planned(sizes: dict[str, int]) -> list[PlannedTensor]:
    """Two tensors per parent layer, in the given order, of the given total bytes."""
    out = []
    for parent, nbytes in sizes.items():
        for part in ("a", "b"):
            entry = TensorEntry(f"{parent}.{part}", "BF16", (nbytes // 4,), "s.safetensors", 0, nbytes // 2)
            out.append(PlannedTensor(entry, parent))
    return out


def _parents(stream: list[PlannedTensor]) -> list[str]:
    return list(dict.fromkeys(item.parent for item in stream))


# ----------------------------------------------------------------------------- the read order

LAYERS = {"embed": 4000, **{f"l{i}.{m}": n for i in range(6) for m, n in (("attn", 100), ("norm", 4), ("mlp", 300))},
          "norm": 4, "head": 4000}


def test_a_large_first_and_last_layer_move_inward_past_half_their_bytes():
    stream = _planned(LAYERS)
    order = _parents(pipelined_order(stream))
    assert order[0] == "l0.attn" and order[-1] == "norm"
    before_embed = order[:order.index("embed")]
    assert sum(LAYERS[name] for name in before_embed) >= 0.5 * LAYERS["embed"]
    after_head = order[order.index("head") + 1:]
    assert sum(LAYERS[name] for name in after_head) >= 0.5 * LAYERS["head"]
    # Each layer's tensors stay together and in their order; nothing is lost or repeated.
    reordered = pipelined_order(stream)
    assert sorted(i.entry.name for i in reordered) == sorted(i.entry.name for i in stream)
    for parent in LAYERS:
        assert [i.entry.name for i in reordered if i.parent == parent] == [f"{parent}.a", f"{parent}.b"]
    # vLLM buffers a layer until it is complete, and only it: the peak is the largest layer either way.
    assert (simulate_buffering(reordered, "layer", {}).peak_buffer_bytes
            == simulate_buffering(stream, "layer", {}).peak_buffer_bytes == 4000)


def test_the_read_order_keeps_small_ends_held_layers_and_split_layers():
    small = {name: 100 for name in ("embed", "a", "b", "c", "head")}
    assert _parents(pipelined_order(_planned(small))) == list(small)
    # A layer vLLM holds to the end of the stream (a padded vocabulary) keeps its place.
    assert _parents(pipelined_order(_planned(LAYERS), held={"embed", "head"})) == list(LAYERS)
    order = _parents(pipelined_order(_planned(LAYERS), held={"head"}))
    assert order[-1] == "head" and order[0] != "embed"
    # A layer in several runs (file order) is left alone: moving a run would move part of a layer.
    split = _planned(LAYERS)
    split = split[2:4] + split[:2] + split[4:] + split[2:4]
    assert pipelined_order(split) == split


# ----------------------------------------------------------------------------- read-ahead

def _written(tmp_path: Path, sd: dict | None = None, **options) -> Path:
    folder = tmp_path / "ckpt"
    save_checkpoint((sd or qwen3_like()).items(), folder, config=CONFIG, max_shard_size=20_000, marker=None,
                    **options)
    return folder


def test_the_reading_thread_starts_before_the_first_tensor_is_asked_for(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    stats = ReadAheadStats()
    opened = open_stream(plan.layer_order, folder, stats=stats)
    try:
        deadline = time.monotonic() + 10
        while stats.read_layers == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stats.read_layers >= 1  # read and checked while nobody asked yet
        names = [item.entry.name for item, _ in opened]
    finally:
        opened.close()
    assert names == [item.entry.name for item in plan.layer_order]


def test_a_stream_closed_unread_stops_its_thread(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    before = {t.ident for t in threading.enumerate()}
    opened = open_stream(plan.layer_order, folder, ahead_bytes=0)
    assert [t for t in threading.enumerate() if t.name == "layerwise-readahead" and t.ident not in before]
    opened.close()
    opened.close()  # twice is fine
    assert not [t for t in threading.enumerate() if t.name == "layerwise-readahead" and t.ident not in before]


def test_a_stream_read_to_its_end_leaves_no_thread_behind(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    for _ in range(3):
        assert len(list(read_in_order(plan.layer_order, folder))) == len(plan.layer_order)
    deadline = time.monotonic() + 5
    while any(t.name == "layerwise-readahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "layerwise-readahead"]


def test_idle_work_runs_while_the_reader_may_not_read_on_and_after_the_stream(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    todo = list(range(5))
    done: list[tuple[int, str]] = []

    def idle() -> bool:
        if not todo:
            return False
        done.append((todo.pop(0), threading.current_thread().name))
        return True

    stats = ReadAheadStats()
    for _ in read_in_order(plan.layer_order, folder, stats=stats, ahead_bytes=0, idle=idle):
        time.sleep(0.002)
    todo.extend(range(5, 8))  # work that appears after the stream (the last layers' fingerprints)
    stats.hashing_done()
    assert [n for n, _ in done] == list(range(8))
    assert {thread for _, thread in done} == {"layerwise-readahead"}


# ----------------------------------------------------------------------------- the shared check

@pytest.mark.parametrize("where", ["first half", "second half", "nowhere"])
def test_the_shared_check_finds_what_the_single_one_finds(where):
    tensors = [torch.randn(1000, dtype=torch.bfloat16), torch.randn(64, 33)]
    if where == "first half":
        tensors[0][10] = float("nan")
    elif where == "second half":
        tensors[1][60, 5] = float("inf")
        tensors[1][63, 32] = float("nan")
    group = [(f"t{i}", "s", t) for i, t in enumerate(tensors)]
    with ThreadPoolExecutor(1) as pool:
        assert first_nonfinite_shared(group, pool.submit) == first_nonfinite(group)
    found = first_nonfinite(group)
    assert (found is None) == (where == "nowhere")
    if where == "second half":
        assert (found.name, found.nan, found.inf) == ("t1", 1, 1)


def test_a_layer_the_engine_waits_for_is_checked_on_two_threads(tmp_path, monkeypatch):
    sd = qwen3_like()
    name = "model.embed_tokens.weight"
    flat = sd[name].reshape(-1)
    flat[-3:] = float("nan")  # in the second half: the helper thread's part
    folder = _written(tmp_path, sd, allow_nonfinite=True)
    plan = inspect_order(str(folder)).plan
    # As where vLLM bound the engine: the reading thread runs beside it, the helper on the engine's CPUs.
    monkeypatch.setattr(stream_module, "spare_cpus", lambda: set(os.sched_getaffinity(0)))
    monkeypatch.setattr(layer_module, "_SHARED_CHECK_BYTES", 1)
    checks = []
    original = layer_module.first_nonfinite_shared
    monkeypatch.setattr(layer_module, "first_nonfinite_shared",
                        lambda tensors, submit: checks.append(len(tensors)) or original(tensors, submit))
    with pytest.raises(Exception, match=rf"tensor {name} has 3 NaN and 0 Inf values"):
        list(read_in_order(plan.layer_order, folder))
    assert checks  # the first layer went through the shared check


# ----------------------------------------------------------------------------- early fingerprints

class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)


def test_early_fingerprints_equal_late_ones_unless_something_touched_the_layer():
    model = _Model()
    modules = dict(model.named_modules())
    covers = {"a": ["a"], "b": ["b"], "c": ["c", "b"]}  # c covers a module deriving from it: taken at the end
    early = EarlyFingerprints(modules, covers)
    for name in ("a", "b", "c"):
        early.layer_done(name)
    while early.step():
        pass
    late = layer_fingerprints(modules, {name: covers[name] for name in ("a", "b")})
    assert early.valid([]) == late
    assert set(early.valid(["b.weight_packed", "x"])) == {"a"}  # a module inside b was refreshed
    assert set(early.valid(["a"])) == {"b"}
    # A tensor handed over for a layer already done makes its early fingerprint worthless.
    early.handing_over("a")
    assert set(early.valid([])) == {"b"}
    # And a layer changed after its fingerprint (not by the reload) no longer matches: the record would refuse it.
    with torch.no_grad():
        model.b.weight.add_(1)
    assert early.valid([])["b"] != layer_fingerprints(modules, {"b": ["b"]})["b"]


class _Mixer(torch.nn.Module):
    """A Mamba mixer's shape: tensors of its own, and submodules that are parent layers of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.ones(4))
        self.conv1d = torch.nn.Linear(4, 4)


def test_a_layer_around_one_handed_over_after_it_is_fingerprinted_again():
    mixer = torch.nn.Module()
    mixer.mixer = _Mixer()
    modules = dict(mixer.named_modules())
    early = EarlyFingerprints(modules, {"mixer": ["mixer"], "mixer.conv1d": ["mixer.conv1d"]})
    early.layer_done("mixer")  # its own tensor A came first, in layer order
    while early.step():
        pass
    assert set(early.valid([])) == {"mixer"}
    # Then conv1d, a layer inside it, is handed over: the mixer's fingerprint covers conv1d's old weights.
    early.handing_over("mixer.conv1d")
    with torch.no_grad():
        mixer.mixer.conv1d.weight.add_(1)
    early.layer_done("mixer.conv1d")
    while early.step():
        pass
    assert set(early.valid([])) == {"mixer.conv1d"}


# ----------------------------------------------------------------------------- the plan cache

def test_the_plan_cache_keys_on_structure_not_on_metadata(tmp_path):
    a = open_checkpoint(str(_written(tmp_path / "a")))
    b = open_checkpoint(str(_written(tmp_path / "b", {k: v + 1 for k, v in qwen3_like().items()})))
    assert structure_key(a, False) == structure_key(b, False)  # another step's bytes, digests in the header
    assert a.shards[0].metadata != b.shards[0].metadata
    assert structure_key(a, False) != structure_key(a, True)
    reshaped = replace(a, shards=[replace(a.shards[0], tensors=[replace(t, shape=(*t.shape, 1)) if i == 0 else t
                                                               for i, t in enumerate(a.shards[0].tensors)]),
                                  *a.shards[1:]])
    assert structure_key(reshaped, False) != structure_key(a, False)
    assert structure_key(replace(a, config={**a.config, "vocab_size": 1}), False) != structure_key(a, False)
    cache = PlanCache()
    assert cache.get(structure_key(a, False)) is None
    cache.put(structure_key(a, False), "plan", ["note"])
    plan, notes = cache.get(structure_key(b, False))
    notes.append("added by the caller")
    assert (plan, cache.get(structure_key(b, False))[1], cache.hits) == ("plan", ["note"], 2)
    assert cache.get(structure_key(reshaped, False)) is None


def test_fingerprints_read_by_two_threads_equal_those_read_by_one():
    model = torch.nn.ModuleDict({f"l{i}": torch.nn.Linear(64 * (i + 1), 64) for i in range(5)})
    modules = dict(model.named_modules())
    layers = {f"l{i}": [f"l{i}"] for i in range(5)}
    one = layer_fingerprints(modules, layers)
    cpus = set(os.sched_getaffinity(0))
    assert layer_fingerprints_parallel(modules, layers, cpus, min_bytes=0) == one
    assert list(layer_fingerprints_parallel(modules, layers, cpus, min_bytes=0)) == list(layers)
    assert layer_fingerprints_parallel(modules, layers, set()) == one


def _state(pid: int) -> str:
    """Process PID's state letter in /proc (R, S, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_cpu_another_vllm_worker_is_bound_to_is_never_spare():
    cpu = max(os.sched_getaffinity(0))

    def process(title: str | None, cpus: set[int] | None) -> subprocess.Popen:
        """A process titled as vLLM titles its workers (or not), bound to CPUS (or left unbound)."""
        script = "import ctypes, os, time; "
        if title is not None:
            script += f"ctypes.CDLL(None).prctl(15, {title.encode()!r}, 0, 0, 0); "
        if cpus is not None:
            script += f"os.sched_setaffinity(0, {cpus!r}); "
        script += "print('ready', flush=True); time.sleep(60)"
        started = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert started.stdout.readline().strip() == "ready"
        return started

    everything = set(range(os.cpu_count() or 1))
    # As another server's worker would be; a process of another name; a worker vLLM left unbound.
    worker, other, unbound = (process("VLLM::Worker_TP1", {cpu}), process(None, {cpu}),
                              process("VLLM::Worker", everything))
    try:
        assert bound_worker_cpus(pids=[worker.pid]) == {cpu}
        assert bound_worker_cpus(exclude=worker.pid, pids=[worker.pid]) == set()
        assert bound_worker_cpus(pids=[other.pid, unbound.pid]) == set()
        assert cpu in bound_worker_cpus()  # the scan of every process finds it too
        # Killed and not reaped yet (a zombie, as a crashed server's worker is for a while): it holds nothing.
        worker.kill()
        deadline = time.monotonic() + 10
        while _state(worker.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(worker.pid) == "Z"
        assert bound_worker_cpus(pids=[worker.pid]) == set()
    finally:
        for started in (worker, other, unbound):
            started.kill()
            started.wait()
