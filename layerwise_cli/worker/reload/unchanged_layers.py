"""One reload's unchanged layers: which layers it hands over, which it skips, and what it records afterwards."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from layerwise_cli.checkpoint.format.digests import header_digests, layer_digest
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.vllm_logs import quiet_skipped_layer_warnings
from layerwise_cli.worker.reload.rerun_hooks import RerunHooks, rerun_hooks
from layerwise_cli.worker.repairs.after_reload import derived_modules
from layerwise_cli.worker.repairs.amx_mla import must_hand_over
from layerwise_cli.worker.state.layer_records import LayerRecord, LayerRecords, SkipDecider
from layerwise_cli.worker.state.layer_state import layer_fingerprints, layer_fingerprints_parallel
from layerwise_cli.worker.state.spot_check import SpotCheck, StaleDigest, spot_check
from layerwise_cli.worker.stream.cpu_placement import spare_cpus


@dataclass
class LayerSkip:
    """Built before the engine is touched (`build`); filled while streaming; `record` after a successful reload.

    Attributes:
        stream: the tensors to read, without the layers skipped from their header digests.
        hash_layers: layers whose digest is not in the headers, or whose header digest failed its spot
            check: hashed as they are read.
        skip_layer: the decision for a hashed layer once read (None: none is skipped after reading).
        skipped: every layer skipped, from headers (after their spot check) or after reading.
        read_digests: tensor digests computed while reading.
        read_samples: tensor sample digests taken while reading (`checkpoint.samples`).
        layer_sizes: layer -> (tensors, bytes) in the source, on this rank.
        spot: the spot check of the layers the header digests would skip (None: none were).
    """

    records: LayerRecords | None
    decider: SkipDecider | None
    known: dict[str, str | None]
    covers: dict[str, list[str]]
    modules: dict[str, torch.nn.Module]
    groups: dict[str, list[str]]
    stream: list[PlannedTensor]
    hash_layers: set[str]
    skip_layer: object
    layer_sizes: dict[str, tuple[int, int]]
    skipped: set[str] = field(default_factory=set)
    read_digests: dict[str, str] = field(default_factory=dict)
    read_samples: dict[str, str] = field(default_factory=dict)
    handed: set[str] = field(default_factory=set)
    fingerprint_s: float = 0.0
    spot: SpotCheck | None = None
    # The model's tensors are in host memory (fingerprints are then read by two threads where a spare CPU is).
    on_host: bool = False
    # Layers vLLM's rerun of module hooks forbids to skip (vLLM 0.34; none before).
    rerun: RerunHooks = field(default_factory=RerunHooks)
    # Layers a sparse delta patches in place (`delta_patch`): not handed over, recorded by the patch.
    patched: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, model: torch.nn.Module, checkpoint: Checkpoint, engine_stream: list[PlannedTensor], order: str,
              records: LayerRecords | None, *, all_layers: bool = False, checks_finite: bool = True,
              on_host: bool = False, fetch_windows=None) -> LayerSkip:
        """Decide what can be decided before reading: records against header digests and the layers' state.

        Args:
            model: this worker's model.
            checkpoint: the whole source (its headers carry the digests, if any).
            engine_stream: this rank's tensors in stream order, parents in engine names.
            order: `layer` or `file`; only layer order decides after reading
                (file order interleaves layers, so a layer is never whole before its first handover).
            records: the worker's records (None: skip nothing, record nothing).
            all_layers: skip nothing, record everything handed over.
            checks_finite: this reload refuses NaN/Inf.
            on_host: the model's tensors are in host memory (its fingerprints may then be read by two threads).
            fetch_windows: for a source streamed from the Hub, what fetches the spot check's sample windows
                (`spot_check`); None: the local shards are read.
        """
        groups: dict[str, list[str]] = {}
        sizes: dict[str, list[int]] = {}
        for item in engine_stream:
            if item.parent is not None:
                groups.setdefault(item.parent, []).append(item.entry.name)
                size = sizes.setdefault(item.parent, [0, 0])
                size[0] += 1
                size[1] += item.entry.nbytes
        layer_sizes = {name: (count, nbytes) for name, (count, nbytes) in sizes.items()}
        if records is None:
            return cls(None, None, dict.fromkeys(groups), {}, {}, groups, list(engine_stream), set(), None,
                       layer_sizes)
        from_headers: dict[str, str] = {}
        for shard in checkpoint.shards:
            where = str(checkpoint.local_dir / shard.name) if checkpoint.local_dir is not None else shard.name
            found = header_digests(shard, where=where)
            if found:
                from_headers.update(found)
        known = {name: layer_digest({t: from_headers[t] for t in tensors})
                 if all(t in from_headers for t in tensors) else None for name, tensors in groups.items()}
        modules = dict(model.named_modules())
        derived = derived_modules(model, set(groups))
        covers = {name: [name] + sorted(d for d, origin in derived.items() if origin == name) for name in groups}
        plan = cls(records, None, known, covers, modules, groups, [], set(), None, layer_sizes)
        plan.on_host = on_host
        if not all_layers:  # with --all nothing is skipped: no hook can forbid it
            plan.rerun = rerun_hooks(model, groups)
        # Layers vLLM's AMX MLA backend keeps no copy of are loaded by every reload (`amx_mla`).
        plan.decider = SkipDecider(records, known, plan._fingerprints, all_layers=all_layers,
                                   checks_finite=checks_finite, never=plan.rerun.hand_over | must_hand_over(model))
        before = plan.decider.skip_before_reading()
        if before:
            # A header digest is the file's claim: the sampled bytes must be those the engine loaded.
            entries: dict[str, list] = {}
            for item in engine_stream:
                if item.parent in before:
                    entries.setdefault(item.parent, []).append(item.entry)
            plan.spot = spot_check(before, entries, records, checkpoint, fetch_windows)
            # The others are streamed like layers without header digests: a stale one (its samples differ) is
            # loaded and its refuted claim never recorded; one whose record lacked samples is hashed only if it
            # could still be skipped.
            plan.hash_layers |= before - plan.spot.confirmed
            before = plan.spot.confirmed
        plan.skipped |= before
        plan.stream = [item for item in engine_stream if item.parent not in before]
        plan.hash_layers |= {name for name, digest in known.items() if digest is None}
        if order == "layer" and not all_layers:
            plan.skip_layer = plan.decider.skip_after_reading
        return plan

    def samples_match(self, name: str, samples: dict[str, str]) -> bool:
        """Whether a layer's samples as read equal its record's: only then can hashing it in full lead to a skip."""
        record = self.records.get(name) if self.records is not None else None
        return record is not None and all(record.samples.get(t) == d for t, d in samples.items())

    def _fingerprints(self, names: list[str], known: Mapping[tuple[int, int], int] | None = None) -> dict[str, object]:
        """The layers' states now (`layer_state`); KNOWN: checksums of host tensors just hashed, not read again."""
        start = time.perf_counter()
        try:
            layers = {name: self.covers[name] for name in names}
            if self.on_host:
                # Nothing writes the engine's tensors now: half of them are read on the CPUs beside the engine.
                return layer_fingerprints_parallel(self.modules, layers, spare_cpus(), known=known)
            return layer_fingerprints(self.modules, layers, known)
        finally:
            self.fingerprint_s += time.perf_counter() - start

    def handing_over(self, parent: str | None) -> None:
        """Called before each tensor goes to vLLM: the first tensor of a layer drops the layer's record."""
        if parent is not None and parent not in self.handed:
            self.handed.add(parent)
            if self.records is not None:
                self.records.drop(parent)

    def record(self, model: torch.nn.Module, *, checked: bool, fingerprints: dict[str, object] | None = None) -> None:
        """After a successful reload: record every layer handed over, with its digest and its state now.

        FINGERPRINTS: layers' states already taken since vLLM finished them and still true
        (`early_fingerprints`); the others are taken now.
        """
        if self.records is None or not (self.handed or self.patched):
            return
        digests: dict[str, str | None] = {}
        for name in self.handed:
            tensors = self.groups.get(name, [])
            # The digest of the bytes as read wins over a header's claim; a claim the spot check refuted is
            # never recorded.
            if tensors and all(t in self.read_digests for t in tensors):
                digest = layer_digest({t: self.read_digests[t] for t in tensors})
            elif self.spot is not None and name in self.spot.refuted():
                digest = None
            else:
                digest = self.known.get(name)
            if tensors and all(t in self.read_samples for t in tensors):
                digests[name] = digest  # None: recorded by its samples alone
        ready = fingerprints or {}
        now = {name: ready[name] for name in digests if name in ready}
        around = self._skipped_around_handed()
        now.update(self._fingerprints(sorted({name for name in digests if name not in ready} | set(around))))
        for name, digest in digests.items():
            samples = {t: self.read_samples[t] for t in self.groups.get(name, [])}
            self.records.set(name, LayerRecord(digest, now[name], checked, samples))
        for name, record in around.items():
            self.records.set(name, replace(record, fingerprint=now[name]))

    def _skipped_around_handed(self) -> dict[str, LayerRecord]:
        """The records of skipped layers that enclose a layer handed over (a Mamba mixer whose own tensors are
        unchanged, around its `conv1d` and projections, layers of their own).

        A layer's fingerprint covers its submodules: this reload changed such a layer's state by loading (or
        patching) the layers inside it, not its own tensors, so its record keeps its digest and takes its state
        now.
        """
        found = {}
        changed = self.handed | self.patched
        for name in self.skipped - changed:
            record = self.records.get(name) if self.records is not None else None
            if record is not None and any(inner.startswith(name + ".") for inner in changed):
                found[name] = record
        return found

    @property
    def not_handed(self) -> set[str]:
        """The layers not handed to vLLM: skipped as unchanged, or patched in place."""
        return self.skipped | self.patched

    def skipped_classes(self, model: torch.nn.Module) -> Counter:
        """Class names of the modules skipped or patched so far (vLLM warns once per layer it got nothing for)."""
        modules = self.modules or dict(model.named_modules())
        return Counter(type(modules[name]).__name__ for name in self.not_handed if name in modules)

    def digest_source(self) -> str:
        """`header` (every layer's digest came from the shard headers), `read` (hashed as read), `mixed`, or `none`."""
        if self.records is None or not self.known:
            return "none"
        from_headers = sum(1 for digest in self.known.values() if digest is not None)
        if from_headers == len(self.known):
            return "header"
        return "read" if from_headers == 0 else "mixed"

    def notes(self) -> list[str]:
        """What the report should say about the records (layers something else changed)."""
        notes = [found.describe() for found in self.stale_digests()]
        forced = self.rerun.note(name for name in self.rerun.hand_over if self.records.get(name))
        if forced:
            notes.append(forced)
        stale = self.decider.stale if self.decider is not None else []
        if stale:
            notes.append(f"{len(stale)} layer(s) matched the source's digest but their state in the engine changed "
                         "since layerwise loaded them (another reload, a rollback): reloaded, not skipped")
        return notes

    def stale_digests(self) -> list[StaleDigest]:
        """Layers whose header digest claimed the engine's bytes while their sampled bytes differ."""
        return list(self.spot.stale) if self.spot is not None else []


def quiet_skipped_layers(plan: LayerSkip, model: torch.nn.Module):
    """While vLLM's reload runs: drop its warnings about the layers skipped on purpose (see `vllm_logs`)."""
    return quiet_skipped_layer_warnings(lambda: plan.skipped_classes(model))
