"""Reading into place, our own logic: which loader calls are plain copies, the skipped replay, the pass itself.

The engine tests (`test_read_into_place_engine.py`) prove it on vLLM's own
loaders; here each rule is shown on loaders written to break it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from layerwise_cli.checkpoint.header import TensorEntry
from layerwise_cli.checkpoint.samples import buffer_sample
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.loader_copies import (
    Filled,
    LoaderFacts,
    LoaderWatch,
    PlainCopy,
    TensorCopies,
    _CountWatch,
    _ReplaySkip,
)
from layerwise_cli.worker.stream.read_into_place import CHUNK_BYTES, PlaceReader, plan_into_place


class Layer(torch.nn.Module):
    def __init__(self, rows: int, cols: int, device: str = "meta") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=torch.bfloat16, device=device),
                                         requires_grad=False)


def model_of(layer: Layer) -> torch.nn.Module:
    model = torch.nn.Module()
    model.proj = layer
    return model


def counted(loader, rows: int = 6, cols: int = 4, src: torch.Tensor | None = None) -> TensorCopies | tuple | None:
    """What the watch learns from one loader call on a meta layer, as vLLM's count runs it."""
    layer = Layer(rows, cols)
    watch = LoaderWatch(model_of(layer))
    src = src if src is not None else torch.randn(2, cols).to(torch.bfloat16)
    watch.handing("w", "BF16", src)
    with _CountWatch(watch, layer.weight):
        loader(layer.weight, src)
    return watch.seen.get("w")


def test_a_narrowed_copy_is_a_plain_copy_at_its_offset():
    found = counted(lambda param, w: param.data.narrow(0, 2, 2).copy_(w))
    assert found == TensorCopies("BF16", (2, 4), (PlainCopy("proj", "weight", dst_offset=8, src_offset=0, numel=8),))


def test_a_slice_of_the_source_records_where_it_starts():
    src = torch.randn(4, 4).to(torch.bfloat16)
    found = counted(lambda param, w: param.data[:2].copy_(w.narrow(0, 2, 2)), src=src)
    assert found.copies == (PlainCopy("proj", "weight", dst_offset=0, src_offset=8, numel=8),)


@pytest.mark.parametrize("loader", [
    lambda param, w: param.data[:4, :2].copy_(w.t()),  # a transpose: not the file's byte order
    lambda param, w: param.data[:2].copy_(w.float().to(torch.bfloat16)),  # a cast round trip
    lambda param, w: param.data[:2].copy_(w * 2),  # arithmetic
    lambda param, w: param.data[:2].copy_(torch.zeros_like(w)),  # another tensor's bytes
    lambda param, w: (param.data.fill_(0), param.data[:2].copy_(w)),  # a constant the copy then overwrites
    lambda param, w: param.data[:2, :2].copy_(w[:, :2]),  # strided rows
])
def test_anything_but_views_and_contiguous_same_dtype_copies_is_not_plain(loader):
    src = torch.randn(2, 4).to(torch.bfloat16)
    assert counted(loader, src=src) == ("BF16", (2, 4))  # seen, and not a plain copy


def test_a_constant_written_beside_the_copy_keeps_it_plain():
    def vocabulary(param, w):  # vLLM's VocabParallelEmbedding: the rows, then zeros for the padding rows
        param[: w.shape[0]].data.copy_(w)
        param[w.shape[0]:].data.fill_(0)

    found = counted(vocabulary)
    assert found.copies == (PlainCopy("proj", "weight", dst_offset=0, src_offset=0, numel=8),)


def test_the_replay_skips_exactly_the_copy_of_bytes_already_in_place():
    engine = torch.zeros(8, dtype=torch.bfloat16)
    src = torch.arange(8, dtype=torch.bfloat16)
    watch = LoaderWatch(torch.nn.Module())
    engine[:4].copy_(src[:4])  # as the reader did
    watch.fill(Filled("proj", engine[:4].data_ptr(), src.data_ptr(), 4, torch.bfloat16), torch.nn.Module())
    other = torch.full((4,), 7, dtype=torch.bfloat16)
    with _ReplaySkip(watch):
        engine[:4].copy_(src[:4])  # skipped (the same bytes)
        engine[4:].copy_(other)  # not filled: copied
        engine[:2].copy_(other[:2])  # same place, other source: copied
    assert watch.filled[engine.data_ptr()].confirmed
    assert engine.tolist() == [7, 7, 2, 3, 7, 7, 7, 7]
    assert watch.unconfirmed({"proj"}) == []
    watch.fill(Filled("head", engine[4:].data_ptr(), other.data_ptr() + 2, 4, torch.bfloat16), torch.nn.Module())
    assert watch.unconfirmed({"proj", "head"}) == ["head"] and watch.unconfirmed({"proj"}) == []


def shard(tmp_path, tensors: dict) -> tuple:
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    from layerwise_cli.checkpoint.header import read_shard_header

    header, _ = read_shard_header(path)
    entries = {entry.name: entry for entry in header.tensors}
    return path, entries


def planned(entry: TensorEntry, parent: str = "proj") -> PlannedTensor:
    return PlannedTensor(entry=entry, parent=parent)


def facts_for(entry: TensorEntry, copies: tuple[PlainCopy, ...], in_place=("proj",)) -> LoaderFacts:
    return LoaderFacts(copies={entry.name: TensorCopies(entry.dtype, tuple(entry.shape), copies)},
                       in_place=set(in_place))


def test_only_a_tensor_whose_layer_loaded_in_place_and_whose_fact_fits_is_planned(tmp_path):
    rows = (CHUNK_BYTES // 8) + 3  # more than one chunk
    tensor = torch.randn(rows, 4).to(torch.bfloat16)
    _, entries = shard(tmp_path, {"proj.weight": tensor})
    entry = entries["proj.weight"]
    model = model_of(Layer(rows, 4, device="cpu"))
    whole = (PlainCopy("proj", "weight", 0, 0, rows * 4),)
    assert list(plan_into_place(model, facts_for(entry, whole), [planned(entry)])) == ["proj.weight"]
    assert plan_into_place(model, facts_for(entry, whole, in_place=()), [planned(entry)]) == {}
    too_far = (PlainCopy("proj", "weight", 4, 0, rows * 4),)
    assert plan_into_place(model, facts_for(entry, too_far), [planned(entry)]) == {}
    other_dtype = LoaderFacts(copies={entry.name: TensorCopies("F32", tuple(entry.shape), whole)}, in_place={"proj"})
    assert plan_into_place(model, other_dtype, [planned(entry)]) == {}
    meta = model_of(Layer(rows, 4))
    assert plan_into_place(meta, facts_for(entry, whole), [planned(entry)]) == {}


def two_layers(tmp_path, tensors: dict) -> tuple:
    """`proj.weight` and `bad.weight` (bf16, [rows, 4]) in one shard, each a whole plain copy into its layer's
    engine tensor, both layers known to load in place: (model, planned items, reader, watch)."""
    rows = tensors["proj.weight"].shape[0]
    _, entries = shard(tmp_path, tensors)
    model = model_of(Layer(rows, 4, device="cpu"))
    model.bad = Layer(rows, 4, device="cpu")
    whole = {name: TensorCopies("BF16", (rows, 4), (PlainCopy(name.split(".")[0], "weight", 0, 0, rows * 4),))
             for name in entries}
    items = [planned(entries["proj.weight"]), planned(entries["bad.weight"], "bad")]
    watch = LoaderWatch(model)
    reader = PlaceReader(tmp_path, plan_into_place(model, LoaderFacts(copies=whole, in_place={"proj", "bad"}), items),
                         watch)
    return model, items, reader, watch


def test_the_pass_reads_the_bytes_flags_nan_samples_and_hashes_them(tmp_path):
    from layerwise_cli.checkpoint.digests import tensor_digest
    from layerwise_cli.worker.stream.shard_reader import ShardReader, raw_bytes

    rows = (CHUNK_BYTES // 8) + 3
    tensor = torch.randn(rows, 4).to(torch.bfloat16)
    poisoned = tensor.clone()
    poisoned[-1, -1] = torch.nan  # in the last chunk
    model, items, reader, watch = two_layers(tmp_path, {"proj.weight": tensor, "bad.weight": poisoned})
    mapped = ShardReader(tmp_path)
    try:
        good = reader.read(items[0], mapped.read(items[0]), check=True, digest=True)
        bad = reader.read(items[1], mapped.read(items[1]), check=True, digest=False)
    finally:
        reader.close()
    assert torch.equal(model.proj.weight, tensor)
    assert not good.nonfinite and bad.nonfinite
    assert reader.nonfinite(items[1]).nan == 1 and reader.nonfinite(items[0]) is None
    assert good.digest == tensor_digest("BF16", (rows, 4), raw_bytes(tensor)) and bad.digest is None
    assert good.sample == buffer_sample("BF16", (rows, 4), raw_bytes(tensor))
    assert reader.layers == {"proj", "bad"} and reader.bytes == 2 * tensor.numel() * 2
    assert sorted(region.module for region in watch.filled.values()) == ["bad", "proj"]


def test_a_file_cut_short_while_it_is_read_is_named(tmp_path):
    rows = 64
    tensor = torch.randn(rows, 4).to(torch.bfloat16)
    path, entries = shard(tmp_path, {"proj.weight": tensor})
    entry = entries["proj.weight"]
    model = model_of(Layer(rows, 4, device="cpu"))
    reader = PlaceReader(tmp_path, plan_into_place(model, facts_for(entry, (PlainCopy("proj", "weight", 0, 0,
                                                                                      rows * 4),)),
                                                   [planned(entry)]), LoaderWatch(model))
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 16)
    try:
        with pytest.raises(LayerwiseError, match=r"model\.safetensors: the file ends at byte"):
            reader.read(planned(entry), tensor, check=True, digest=False)
    finally:
        reader.close()


def test_facts_hold_what_was_seen_either_way_and_a_reload_without_the_watch_learns_nothing():
    copies = TensorCopies("BF16", (2, 4), (PlainCopy("proj", "weight", 0, 0, 8),))
    facts = LoaderFacts()
    watch = LoaderWatch(torch.nn.Module(), facts)
    watch.seen.update({"a": copies, "b": ("BF16", (4, 4))})
    facts.after_reload(watch, failed=False, in_place=None, handed={"proj"}, watched=True)
    assert facts.knows("a", "BF16", (2, 4)) and facts.knows("b", "BF16", (4, 4))
    assert not facts.knows("a", "F32", (2, 4)) and not facts.knows("c", "BF16", (2, 4))
    facts.in_place = {"proj", "head"}
    # Reading into place off: no copy learned; a layer handed over that did not load in place is dropped.
    facts.after_reload(LoaderWatch(torch.nn.Module(), facts), failed=False, in_place=None, handed={"proj"},
                       watched=False)
    assert facts.in_place == {"head"} and facts.copies == {"a": copies}
    facts.after_reload(watch, failed=True, in_place=None, handed=set(), watched=True)
    assert facts.in_place == set() and facts.copies == {"a": copies}  # a failure forgets what loads in place


def test_two_threads_share_a_layers_chunks_and_digests_as_one_would(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from layerwise_cli.checkpoint.digests import tensor_digest
    from layerwise_cli.worker.stream.shard_reader import ShardReader, raw_bytes
    from layerwise_cli.worker.stream.stats import ReadAheadStats

    rows = 3 * (CHUNK_BYTES // 8) + 5  # four chunks each
    tensors = {f"{name}.weight": torch.randn(rows, 4).to(torch.bfloat16) for name in ("proj", "bad")}
    tensors["bad.weight"][1, 1] = torch.inf  # in the first chunk: the one the other thread takes
    model, items, reader, _ = two_layers(tmp_path, tensors)
    mapped = ShardReader(tmp_path)
    stats, samples, digests = ReadAheadStats(), {}, {}
    helper = ThreadPoolExecutor(1)
    used = set()

    def submit(work, *args):
        used.add(work.__name__)
        return helper.submit(work, *args)

    try:
        found = reader.read_layer(items, mapped.read, stats, samples, digests, check=True, digest=True, submit=submit)
    finally:
        reader.close()
        helper.shutdown()
    assert used == {"drain"}  # the chunks and the digests were both offered to the second thread
    assert torch.equal(model.proj.weight, tensors["proj.weight"]) and torch.equal(model.bad.weight,
                                                                                tensors["bad.weight"])
    assert not found["proj.weight"].nonfinite and found["bad.weight"].nonfinite
    for name, tensor in tensors.items():
        assert digests[name] == found[name].digest == tensor_digest("BF16", (rows, 4), raw_bytes(tensor))
        assert samples[name] == buffer_sample("BF16", (rows, 4), raw_bytes(tensor))
    assert stats.read_bytes == 2 * tensor.numel() * 2 and stats.read_s > 0 and stats.hash_s > 0


def test_a_failure_on_either_thread_stops_both_before_it_is_raised(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from layerwise_cli.worker.stream.read_into_place import _share
    from layerwise_cli.worker.stream.stats import ReadAheadStats

    done = []

    def work(job):
        if job == 3:
            raise LayerwiseError("cut short")
        done.append(job)
        return 0.0, 0.0

    helper = ThreadPoolExecutor(1)
    try:
        with pytest.raises(LayerwiseError, match="cut short"):
            _share(work, list(range(100)), helper.submit, ReadAheadStats())
        count = len(done)
        helper.submit(lambda: None).result()  # whatever the other thread was doing has finished
        assert len(done) == count < 100  # nothing ran after the failure was raised, and the rest never ran
    finally:
        helper.shutdown()
