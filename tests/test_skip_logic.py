"""Skipping unchanged layers, without an engine: the decision, the records, the layer state, the stream, the report."""

from __future__ import annotations

import itertools
import logging
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerwise_cli.checkpoint.format.digests import checkpoint_digests, layer_digest
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.format.samples import WINDOW_BYTES, WINDOWS, buffer_sample, sample_bytes, sample_spans
from layerwise_cli.cli._reload_view import render_report
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.report.records import LayerReport
from layerwise_cli.report.reload_report import ReloadReport, merge_reports
from layerwise_cli.vllm_logs import INPLACE_LOGGER, RELOAD_LOGGER, quiet_skipped_layer_warnings
from layerwise_cli.worker.reload.unchanged_layers import LayerSkip
from layerwise_cli.worker.state.layer_records import LayerRecord, LayerRecords, SkipDecider, records_of
from layerwise_cli.worker.state.layer_state import device_checksum, host_checksum, layer_fingerprints
from layerwise_cli.worker.stream.read_ahead import read_in_order
from layerwise_cli.worker.stream.stats import ReadAheadStats
from layerwise_cli.writer.save import save_checkpoint
from tests.support.log_levels import loggers_at
from tests.support.reports import report_of
from tests.support.small_qwen3 import CONFIG, qwen3_like

# ----------------------------------------------------------------------------- the decision


class Fingerprints:
    """A fake `fingerprint_now` that counts the layers it was asked about."""

    def __init__(self, now: dict[str, object]) -> None:
        self.now = now
        self.asked: list[str] = []

    def __call__(self, names: list[str]) -> dict[str, object]:
        self.asked += names
        return {name: self.now.get(name) for name in names}


def records(**entries: LayerRecord) -> LayerRecords:
    out = LayerRecords()
    for name, record in entries.items():
        out.set(name, record)
    return out


def test_a_layer_is_skipped_only_when_digest_and_state_match():
    recs = records(a=LayerRecord("d-a", "fp-a", True), b=LayerRecord("d-b", "fp-b", True),
                   c=LayerRecord("d-c", "fp-c", True))
    fps = Fingerprints({"a": "fp-a", "b": "fp-b", "c": "CHANGED"})
    decider = SkipDecider(recs, {"a": "d-a", "b": "NEW", "c": "d-c", "d": "d-d"}, fps)
    assert decider.skip_before_reading() == {"a"}
    assert fps.asked == ["a", "c"]  # b changed in the source and d has no record: the engine is not looked at
    assert decider.stale == ["c"]


def test_all_layers_skips_nothing_and_looks_at_nothing():
    recs = records(a=LayerRecord("d-a", "fp-a", True))
    fps = Fingerprints({"a": "fp-a"})
    decider = SkipDecider(recs, {"a": "d-a"}, fps, all_layers=True)
    assert decider.skip_before_reading() == set() and fps.asked == []
    assert not decider.skip_after_reading("a", "d-a")


def test_a_layer_vllm_would_rerun_a_hook_on_is_never_skipped():
    """`never` (worker/rerun_hooks.py): handed over before and after reading, its state not even looked at."""
    recs = records(a=LayerRecord("d-a", "fp-a", True), b=LayerRecord("d-b", "fp-b", True))
    fps = Fingerprints({"a": "fp-a", "b": "fp-b"})
    decider = SkipDecider(recs, {"a": "d-a", "b": None}, fps, never=frozenset({"a", "b"}))
    assert decider.skip_before_reading() == set() and fps.asked == []
    assert not decider.skip_after_reading("b", "d-b")
    assert SkipDecider(recs, {"a": "d-a"}, Fingerprints({"a": "fp-a"})).skip_before_reading() == {"a"}


def test_a_record_loaded_without_the_nan_check_allows_a_skip_only_without_it():
    recs = records(a=LayerRecord("d-a", "fp-a", checked=False))
    assert SkipDecider(recs, {"a": "d-a"}, Fingerprints({"a": "fp-a"})).skip_before_reading() == set()
    assert SkipDecider(recs, {"a": "d-a"}, Fingerprints({"a": "fp-a"}),
                       checks_finite=False).skip_before_reading() == {"a"}


def test_without_header_digests_the_decision_waits_for_the_bytes():
    recs = records(a=LayerRecord("d-a", "fp-a", True), b=LayerRecord("d-b", "OLD", True))
    fps = Fingerprints({"a": "fp-a", "b": "fp-b"})
    decider = SkipDecider(recs, {"a": None, "b": None}, fps)
    assert decider.skip_before_reading() == set()
    assert sorted(fps.asked) == ["a", "b"]  # every recorded layer: its digest is known only once read
    assert decider.skip_after_reading("a", "d-a")
    assert not decider.skip_after_reading("a", "d-a-changed")
    assert not decider.skip_after_reading("b", "d-b")  # same bytes, but something else wrote the layer
    assert decider.stale == ["b"]


def test_every_worker_process_has_its_own_engine_id():
    class Worker:
        pass

    one, two = Worker(), Worker()
    assert records_of(one) is records_of(one)
    assert records_of(one).engine_id != records_of(two).engine_id
    assert len(records_of(one).engine_id) == 32


# ----------------------------------------------------------------------------- the layer state


def test_device_checksum_sees_every_word_and_its_position():
    tensor = torch.randn(1000, 37).to(torch.bfloat16)
    base = device_checksum(tensor)
    assert device_checksum(tensor.clone()) == base
    flat = tensor.clone().reshape(-1)
    flat[1234] = flat[1234] + 1
    assert device_checksum(flat) != base
    swapped = tensor.clone().reshape(-1)
    first, second = swapped[10].clone(), swapped[5000].clone()
    assert first != second
    swapped[10], swapped[5000] = second, first
    assert device_checksum(swapped) != base
    odd = torch.arange(7, dtype=torch.uint8)  # a tail shorter than a word
    changed = odd.clone()
    changed[6] = 99
    assert device_checksum(odd) != device_checksum(changed)


def test_host_checksum_reads_the_bytes_in_place():
    tensor = torch.randn(64, 64).to(torch.bfloat16)
    base = host_checksum(tensor)
    assert host_checksum(tensor.clone()) == base
    tensor[3, 3] += 1
    assert host_checksum(tensor) != base


def test_a_layer_fingerprint_changes_with_content_or_kernel_handle_not_otherwise():
    layer = torch.nn.Linear(8, 8)
    modules = {"layer": layer}

    def fingerprint():
        return layer_fingerprints(modules, {"layer": ["layer"]})["layer"]

    first = fingerprint()
    assert fingerprint() == first
    with torch.no_grad():
        layer.weight[0, 0] += 1
    second = fingerprint()
    assert second != first
    layer.cpu_linear = lambda x, weight, bias: x  # a kernel handle, as vLLM's CPU backend sets
    third = fingerprint()
    assert third != second and fingerprint() == third
    layer.cpu_linear = lambda x, weight, bias: x  # a reload builds a new one: the weights it packs are unknown
    assert fingerprint() != third


def test_a_layer_on_the_meta_device_or_missing_never_matches():
    layer = torch.nn.Linear(4, 4, device="meta")
    got = layer_fingerprints({"layer": layer}, {"layer": ["layer"], "gone": ["gone"]})
    again = layer_fingerprints({"layer": layer}, {"layer": ["layer"], "gone": ["gone"]})
    assert got["layer"] != again["layer"] and got["gone"] != again["gone"]


def test_a_tied_module_is_part_of_the_layer_it_shares_storage_with():
    embed = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    head.cpu_linear = lambda x, weight, bias: x
    modules = {"embed": embed, "head": head}
    first = layer_fingerprints(modules, {"embed": ["embed", "head"]})["embed"]
    head.cpu_linear = lambda x, weight, bias: x  # only the head's packed copy was rebuilt
    assert layer_fingerprints(modules, {"embed": ["embed", "head"]})["embed"] != first


# ----------------------------------------------------------------------------- digests while streaming


def _written(tmp_path: Path, seed: int = 0, *, change: tuple[str, ...] = ()) -> Path:
    sd = qwen3_like(seed=seed)
    for name in change:
        sd[name] = sd[name] + 1
    folder = tmp_path / f"ckpt-{seed}-{len(change)}"
    save_checkpoint(sd.items(), folder, config=CONFIG, max_shard_size=20_000, marker=None)
    return folder


def test_digests_hashed_while_reading_equal_the_header_digests(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    from_headers = checkpoint_digests(plan.checkpoint.shards)
    assert from_headers is not None
    digests: dict[str, str] = {}
    names = [item.entry.name for item, _ in read_in_order(plan.layer_order, folder,
                                                           hash_layers={layer.name for layer in plan.layers},
                                                           digests=digests, skip_layer=lambda p, d: False)]
    assert names == [item.entry.name for item in plan.layer_order]
    assert digests == from_headers


@pytest.mark.parametrize("readahead", [True, False])
def test_a_layer_skipped_after_reading_is_never_handed_over(tmp_path, readahead):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    layers = {layer.name: [i.entry.name for i in plan.layer_order if i.parent == layer.name] for layer in plan.layers}
    digests: dict[str, str] = {}
    decided: list[str] = []

    def skip_layer(parent: str, digest: str) -> bool:
        assert digest == layer_digest({name: digests[name] for name in layers[parent]})
        decided.append(parent)
        return ".mlp." in parent

    skipped: set[str] = set()
    stats = ReadAheadStats()
    handed = [item.parent for item, _ in read_in_order(
        plan.layer_order, folder, readahead=readahead, stats=stats, hash_layers=set(layers), digests=digests,
        skip_layer=skip_layer, skipped=skipped)]
    assert decided == list(dict.fromkeys(item.parent for item in plan.layer_order))
    assert skipped == {name for name in layers if ".mlp." in name} and skipped
    assert set(handed) == set(layers) - skipped
    assert stats.read_bytes == plan.total_bytes  # read (to hash), not handed over
    largest = max(layer.bytes for layer in plan.layers)
    # Held, read but not handed over: the layer in hand, plus (read-ahead on the CPU) up to two largest layers.
    assert stats.peak_bytes <= (3 * largest if readahead else largest)


def test_read_ahead_holds_at_most_what_it_is_allowed(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    sizes = [layer.bytes for layer in plan.layers]
    for ahead, bound in ((0, max(a + b for a, b in itertools.pairwise(sizes))), (None, 3 * max(sizes))):
        stats = ReadAheadStats()
        names = []
        for item, _ in read_in_order(plan.layer_order, folder, stats=stats, ahead_bytes=ahead):
            names.append(item.entry.name)
            time.sleep(0.003)  # the engine's work: the reader runs ahead as far as it may
        assert names == [item.entry.name for item in plan.layer_order]
        assert stats.peak_bytes <= bound, (ahead, stats.peak_bytes, bound)
        # One layer ahead holds more than the layer in hand alone; the CPU default holds more still.
        assert stats.peak_bytes > max(sizes) if ahead is None else stats.peak_bytes >= max(sizes)


# ----------------------------------------------------------------------------- the unchanged layers of one reload


class TinyModel(torch.nn.Module):
    """Modules named as the Qwen3-like checkpoint's parent layers, each holding one tensor per checkpoint tensor."""

    def __init__(self, plan) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        for layer in plan.layers:
            module = torch.nn.Module()
            for i, item in enumerate(i for i in plan.layer_order if i.parent == layer.name):
                module.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(item.entry.shape),
                                                                      requires_grad=False))
            self.layers[layer.name.replace(".", "_")] = module


def _unchanged_layers(folder: Path, model: TinyModel, recs: LayerRecords, **kwargs):
    plan = inspect_order(str(folder)).plan
    stream = [PlannedTensor(item.entry, "layers." + item.parent.replace(".", "_")) for item in plan.layer_order]
    return LayerSkip.build(model, plan.checkpoint, stream, "layer", recs, **kwargs), stream


def _load(skip, stream, folder: Path) -> None:
    """What a reload does with the plan before it records: read the stream (samples, hashes), hand it over."""
    stats = ReadAheadStats()
    for item, _ in read_in_order(skip.stream, folder, hash_layers=skip.hash_layers, digests=skip.read_digests,
                                 samples=skip.read_samples, stats=stats):
        skip.handing_over(item.parent)
    if stats.hashing_done is not None:
        stats.hashing_done()


def test_header_digests_decide_without_reading_and_records_follow_the_engine(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    model = TinyModel(plan)
    recs = LayerRecords()
    first, stream = _unchanged_layers(folder, model, recs)
    assert first.skipped == set() and first.stream == stream and first.hash_layers == set()
    _load(first, stream, folder)
    first.record(model, checked=True)
    assert len(recs) == len(plan.layers)

    second, _ = _unchanged_layers(folder, model, recs)
    assert second.skipped == {item.parent for item in stream} and second.stream == []
    assert second.digest_source() == "header"

    # Something else writes one layer in place: it is reloaded though the source is the same.
    touched = next(iter(model.layers.values()))
    with torch.no_grad():
        next(iter(touched.parameters())).add_(1)
    third, _ = _unchanged_layers(folder, model, recs)
    assert len(third.skipped) == len(plan.layers) - 1 and len(third.decider.stale) == 1
    assert "changed since layerwise loaded them" in third.notes()[0]

    # A changed source layer is read; handing it over drops its record until the reload succeeds.
    changed = _written(tmp_path, change=("model.layers.1.mlp.down_proj.weight",))
    fourth, _ = _unchanged_layers(changed, model, LayerRecords())
    assert fourth.skipped == set()
    fifth, _ = _unchanged_layers(changed, model, recs)
    reread = {item.parent for item in fifth.stream}
    assert "layers.model_layers_1_mlp_down_proj" in reread
    name = next(iter(reread - {"layers.model_layers_1_mlp_down_proj"}), None)  # the stale one
    assert name is not None
    fifth.handing_over("layers.model_layers_1_mlp_down_proj")
    assert "layers.model_layers_1_mlp_down_proj" not in recs  # a failure now leaves no record of it

    everything, _ = _unchanged_layers(folder, model, recs, all_layers=True)
    assert everything.skipped == set() and len(everything.stream) == len(stream)


def _rewrite_keeping_headers(folder: Path, names: set[str], *, window: int | None = None) -> dict[str, str]:
    """Flip the bytes of NAMES in place (all of them, or only sample window WINDOW), every header kept.

    Returns tensor name -> the shard file rewritten.
    """
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = read_shard_header(path)
        with open(path, "r+b") as handle:
            for entry in header.tensors:
                if entry.name not in names:
                    continue
                spans = [(0, entry.nbytes)] if window is None else [sample_spans(entry.nbytes)[window]]
                for offset, length in spans:
                    handle.seek(header.data_start + entry.begin + offset)
                    data = handle.read(length)
                    handle.seek(header.data_start + entry.begin + offset)
                    handle.write(bytes(b ^ 0x01 for b in data))
                files[entry.name] = str(path)
    return files


def test_a_stale_header_digest_is_caught_by_the_spot_check_and_named(tmp_path):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    model = TinyModel(plan)
    recs = LayerRecords()
    first, stream = _unchanged_layers(folder, model, recs)
    _load(first, stream, folder)
    first.record(model, checked=True)
    assert all(recs.get(item.parent).samples for item in stream)

    liar = tmp_path / "liar"
    shutil.copytree(folder, liar)
    tensor = "model.layers.1.mlp.down_proj.weight"
    files = _rewrite_keeping_headers(liar, {tensor})
    layer = "layers.model_layers_1_mlp_down_proj"
    second, _ = _unchanged_layers(liar, model, recs)
    # Every other layer is skipped on its header digest, after its samples matched.
    assert second.skipped == {item.parent for item in stream} - {layer}
    assert second.spot.confirmed == second.skipped and second.spot.bytes_read > 0
    assert [item.parent for item in second.stream] == [layer] and layer in second.hash_layers
    assert [d.to_dict() for d in second.stale_digests()] == [{"layer": layer, "tensor": tensor,
                                                              "file": files[tensor]}]
    assert f"header digest is stale: {files[tensor]}" in second.notes()[0]
    # Reloaded, and hashed after its handover: the record holds the digest of its true bytes, not the claim.
    _load(second, stream, liar)
    second.record(model, checked=True)
    assert recs.get(layer).digest not in (None, second.known[layer]) and recs.get(layer).samples
    # The same liar again: the header's claim no longer matches the record, so the layer is read (no note).
    third, _ = _unchanged_layers(liar, model, recs)
    assert [item.parent for item in third.stream] == [layer] and third.stale_digests() == []


def test_sample_windows_cover_head_middle_and_tail_wherever_the_tensor_lies():
    assert sample_spans(0) == [] and sample_spans(100) == [(0, 100)]
    n = 10 << 20
    spans = sample_spans(n)
    assert len(spans) == WINDOWS and spans[0] == (0, WINDOW_BYTES) and spans[-1] == (n - WINDOW_BYTES, WINDOW_BYTES)
    assert spans[WINDOWS // 2][0] <= n // 2 < spans[WINDOWS // 2][0] + WINDOW_BYTES  # the middle
    assert sample_bytes(n) == WINDOWS * WINDOW_BYTES
    data = bytearray(range(256)) * (n // 256)
    base = buffer_sample("BF16", [n // 2], data)
    # Any sampled byte changes the sample, and so do dtype and shape; a byte between windows does not.
    for offset, length in spans:
        changed = bytearray(data)
        changed[offset + length // 2] ^= 1
        assert buffer_sample("BF16", [n // 2], changed) != base
    between = bytearray(data)
    between[spans[1][0] + WINDOW_BYTES + 10] ^= 1
    assert buffer_sample("BF16", [n // 2], between) == base
    assert buffer_sample("F16", [n // 2], data) != base and buffer_sample("BF16", [2, n // 4], data) != base


@pytest.mark.parametrize("readahead", [True, False])
def test_a_layer_whose_samples_differ_is_hashed_only_after_its_handover(tmp_path, readahead):
    folder = _written(tmp_path)
    plan = inspect_order(str(folder)).plan
    layers = {layer.name for layer in plan.layers}
    digests: dict[str, str] = {}
    stats = ReadAheadStats()
    asked: list[str] = []

    def may_skip(parent: str, samples: dict[str, str]) -> bool:
        asked.append(parent)
        return ".mlp." in parent  # the others "changed": handed over before any hash

    decided: list[str] = []
    handed = [item.parent for item, _ in read_in_order(
        plan.layer_order, folder, stats=stats, hash_layers=layers, digests=digests, readahead=readahead,
        may_skip=may_skip, skip_layer=lambda parent, digest: decided.append(parent) or False)]
    if stats.hashing_done is not None:
        stats.hashing_done()  # what a reload does before it records
    mlp = {name for name in layers if ".mlp." in name}
    assert set(handed) == layers and set(asked) == layers and set(decided) == mlp
    changed = len(layers) - len(mlp)
    assert stats.hashed_after_handover + stats.unhashed_layers == changed
    if readahead:  # hashed while the reader waited: the digests are right
        want = checkpoint_digests(plan.checkpoint.shards)
        assert all(digests[name] == want[name] for name in digests)
        assert stats.hashed_after_handover > 0
    else:  # no reader thread: nothing is hashed after a handover
        assert stats.unhashed_layers == changed
        assert {item.parent for item in plan.layer_order if item.entry.name in digests} == mlp


def _plain(tmp_path: Path) -> Path:
    """The Qwen3-like checkpoint as plain `save_file` writes it: one file, no header digests."""
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in qwen3_like().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(__import__("json").dumps(CONFIG))
    return folder


def test_a_layer_recorded_by_its_samples_alone_is_hashed_when_they_match_then_skipped(tmp_path):
    folder = _plain(tmp_path)
    plan = inspect_order(str(folder)).plan
    model = TinyModel(plan)
    recs = LayerRecords()

    def reload_plain():
        skip, _ = _unchanged_layers(folder, model, recs)
        # No read-ahead thread: a layer handed over unhashed stays unhashed (recorded by its samples).
        for item, _ in read_in_order(skip.stream, folder, hash_layers=skip.hash_layers, digests=skip.read_digests,
                                     samples=skip.read_samples, skip_layer=skip.skip_layer, skipped=skip.skipped,
                                     may_skip=skip.samples_match, readahead=False):
            skip.handing_over(item.parent)
        skip.record(model, checked=True)
        return skip

    layers = {item.parent for item in _unchanged_layers(folder, model, recs)[1]}
    first = reload_plain()  # no records: nothing to skip, nothing hashed, recorded by samples
    assert first.read_digests == {} and first.skipped == set()
    assert all(recs.get(name).digest is None and recs.get(name).samples for name in layers)
    second = reload_plain()  # samples match: hashed, but a record without a digest allows no skip
    assert second.skipped == set() and len(second.read_digests) == len(plan.layer_order)
    assert all(recs.get(name).digest is not None for name in layers)
    third = reload_plain()
    assert third.skipped == layers


def test_without_header_digests_every_layer_is_hashed(tmp_path):
    folder = _plain(tmp_path)
    plan = inspect_order(str(folder)).plan
    skip, stream = _unchanged_layers(folder, TinyModel(plan), LayerRecords())
    assert skip.stream == stream and skip.hash_layers == {item.parent for item in stream}
    assert skip.digest_source() == "read" and skip.skip_layer is not None


# ----------------------------------------------------------------------------- the report


def test_reports_mark_skipped_layers_and_merge_them():
    def worker(tp_rank: int, skipped: bool) -> ReloadReport:
        layers = [LayerReport("a", 1, 100, 0.0, 0.0, 0, skipped="unchanged"),
                  LayerReport("b", 2, 300, 0.1, 0.2, 300, skipped="unchanged" if skipped else None)]
        return report_of(order="layer", source="s", wall_s=0.5, bytes=0 if skipped else 300, tensors=2,
                         peak_buffer_bytes=300, peak_tensor="b.w", predicted_peak_buffer_bytes=300,
                         largest_layer_bytes=300, layers=layers, rank=tp_rank,
                         position={"rank": tp_rank, "tp_rank": tp_rank, "tp_size": 2},
                         skipped_layers=2 if skipped else 1, skipped_bytes=400 if skipped else 100,
                         read_bytes=0 if skipped else 300, engine_id=f"id{tp_rank}", digests="header")

    merged = merge_reports([worker(0, True), worker(1, False)])
    assert [layer.skipped for layer in merged.layers] == ["unchanged", None]
    assert (merged.unchanged.skipped_layers, merged.unchanged.skipped_bytes, merged.volume.read_bytes) == (1, 100, 300)
    assert merged.placement.engine_id == "id0" and [r.engine_id for r in merged.placement.ranks] == ["id0", "id1"]
    assert [r.skipped_layers for r in merged.placement.ranks] == [2, 1]
    data = merged.to_dict()
    assert data["skipped_layers"] == 1 and data["layers"][0]["skipped"] == "unchanged"
    assert ReloadReport.from_dict(data) == merged
    with pytest.raises(AttributeError):
        merged.unchanged.skipped_layers = 3  # type: ignore[misc]


def test_the_table_shows_skipped_layers(capsys):
    report = report_of(order="layer", source="s", wall_s=0.01, bytes=300, tensors=2, peak_buffer_bytes=300,
                       peak_tensor="b.w", predicted_peak_buffer_bytes=300, largest_layer_bytes=300,
                       layers=[LayerReport("model.a", 1, 1024, 0.0, 0.0, 0, skipped="unchanged"),
                               LayerReport("model.b", 2, 300, 0.1, 0.2, 300)],
                       skipped_layers=1, skipped_bytes=1024, digests="header", engine_id="e")
    render_report(report)
    out = capsys.readouterr().out
    assert "a (skipped: unchanged)" in out
    assert "1 of 2 layers (1.00 KiB) unchanged, kept by the engine; digests from the shard headers" in out


# ----------------------------------------------------------------------------- vLLM's log lines


def test_only_the_warnings_of_skipped_layers_are_dropped(caplog):
    caplog.set_level(logging.WARNING)
    # vLLM's logging configuration (once an engine started in this process, by an earlier test) stops its
    # loggers' records at the `vllm` logger, at the level it was started with: the loggers are held at WARNING
    # and caplog's handler is put on them themselves.
    with loggers_at(logging.WARNING, RELOAD_LOGGER, INPLACE_LOGGER) as (reload_log, inplace_log):
        for log in (reload_log, inplace_log):
            log.addHandler(caplog.handler)
        with quiet_skipped_layer_warnings(lambda: Counter({"QKVParallelLinear": 1})):
            reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
            reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")  # one more than was skipped
            reload_log.warning("%s: Failed to load weights", "RowParallelLinear")
            inplace_log.warning("Following weights were not loaded from checkpoint: %s", {"x"})
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
        for log in (reload_log, inplace_log):
            log.removeHandler(caplog.handler)
    # A record reaches caplog's handler once from the logger itself, and once more where it also propagates.
    messages = list(dict.fromkeys((id(record), record.getMessage()) for record in caplog.records))
    assert [message for _, message in messages] == ["QKVParallelLinear: Failed to load weights",
                                                    "RowParallelLinear: Failed to load weights",
                                                    "QKVParallelLinear: Failed to load weights"]


def test_reports_carry_the_time_split_and_the_stale_header_files(capsys):
    def worker(tp_rank: int, stale: list[dict]) -> ReloadReport:
        return report_of(order="layer", source="s", wall_s=0.5, bytes=300, tensors=2, peak_buffer_bytes=300,
                         peak_tensor="b.w", predicted_peak_buffer_bytes=300, largest_layer_bytes=300,
                         layers=[LayerReport("b", 2, 300, 0.1, 0.2, 300)], rank=tp_rank,
                         position={"rank": tp_rank, "tp_rank": tp_rank, "tp_size": 2}, digests="header",
                         read_s=0.01 * (tp_rank + 1), check_s=0.02, handover_s=0.1, vllm_s=0.4 - tp_rank / 10,
                         spot_checked_layers=3, spot_check_bytes=4096 * (tp_rank + 1), spot_check_s=0.001,
                         stale_header_digests=stale, reader_cpus=[1], notes=["header digest is stale: /x/b"])

    stale = [{"layer": "b", "tensor": "b.w", "file": "/x/b"}]
    merged = merge_reports([worker(0, stale), worker(1, stale + [{"layer": "a", "tensor": "a.w", "file": "/x/a"}])])
    assert [d["file"] for d in merged.unchanged.stale_header_digests] == ["/x/a", "/x/b"]  # one entry each, by file
    assert (merged.timings.read_s, merged.timings.vllm_s) == (0.02, 0.4)
    assert (merged.unchanged.spot_check_bytes, merged.placement.reader_cpus) == (8192, [1])
    data = merged.to_dict()
    assert data["stale_header_digests"][1] == stale[0] and data["handover_s"] == 0.1
    assert ReloadReport.from_dict(data) == merged
    render_report(merged)
    out = capsys.readouterr().out
    assert "handover" in out and "spot check of 3 layer(s)" in out and "header digest is stale: /x/b" in out
