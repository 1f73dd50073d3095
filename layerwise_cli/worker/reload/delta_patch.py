"""A sparse delta applied straight into the engine's tensors, for the layers the engine keeps in checkpoint layout.

Where a layer's engine tensors hold the checkpoint's bytes as they are (a plain
copy: no transpose, no cast, no repacking; on a GPU the common case for an
unquantized model at tensor-parallel size 1, on the CPU the norms, the
embeddings and, with vLLM's `F.linear` fallback, the linear layers), a delta
needs no reload: its new values are written at their positions into the
engine's tensor, and only the delta's bytes are read. Every other layer is
rebuilt from the base's files and the patch, and handed to vLLM's reload as
before (`delta.rebuild.rebuilt_tensor`).

Nothing here is taken on a file's or a rule's word:

- **The engine holds the base.** Only layers `delta_base.check_delta_base`
  passed are patched: their record's digest is the step the patch applies to,
  and their state is what it was right after that step was loaded. For a layer
  whose engine tensors the patch writes whole or leaves alone (`proved_after`),
  that state is proved after the patch instead of read before it
  (`prove_state`): every tensor it left alone as recorded, every tensor it
  wrote hashed to the step.
- **The place is found, then shown.** Each patched tensor's place is proposed
  from the module that loads it: the parameter or buffer its name ends with,
  the whole of it, or its share of a fused one in the order of the model's
  `packed_modules_mapping` (q, k, v; gate, up). It is taken only when the
  engine's bytes there sample exactly as the record says the loaded tensor
  did (`checkpoint.samples`). Otherwise the layer goes through vLLM's reload.
- **Nothing else derived from it.** A layer is not patched when any of its
  modules computes with a kernel built from its weights (a CPU kernel handle
  holding a packed copy), owns a buffer derived from a weight that no longer
  shares its storage, shares storage with a module outside it (a tied head),
  or must be handed to vLLM for another reason (`never`).
- **The result is the step.** After the patch, each patched tensor's place
  hashes to the step's digest of that tensor, or the reload fails (and is
  rolled back: the failed layers' records were dropped first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
import xxhash

from layerwise_cli.checkpoint.delta.format import Delta
from layerwise_cli.checkpoint.delta.source import DeltaChain
from layerwise_cli.checkpoint.format.digests import TensorHasher, layer_digest
from layerwise_cli.checkpoint.format.samples import sample_digest
from layerwise_cli.engine_defaults import decode_ahead_disabled
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.reload.decode_ahead import DecodeAhead
from layerwise_cli.worker.reload.patch_sites import PatchSite, find_site, not_patchable, stored
from layerwise_cli.worker.reload.patch_writes import decode_chunks, write_links
from layerwise_cli.worker.reload.proof_thread import ProofThread, written_mark
from layerwise_cli.worker.state.layer_records import LayerRecord, LayerRecords
from layerwise_cli.worker.stream.cpu_placement import spare_cpus

# The bytes hashed at a time when a patched tensor is proved: small enough to stay in cache for the second hash.
_PROOF_CHUNK = 1 << 18


@dataclass
class DeltaPatch:
    """The layers one delta reload patches in place (`plan`), and what patching them did (`apply`).

    Attributes:
        sites: layer -> where each of its tensors that a link patches lies in the engine.
        links: layer -> the links it takes, oldest first (those after the step it holds).
        not_patched: layer -> why it goes through vLLM's reload instead (for the report's notes and tests).
        patched: the layers patched so far.
        read_bytes: the delta's bytes read for them (positions and values).
        seconds: the time the patch took, its proof included.
        samples: tensor -> its sample digest after the patch (for the records).
        previous: layer -> its record before the patch (the samples of its tensors no link changes).
        proved_after: the patched layers whose every engine tensor the patch either writes whole (its sites
            cover it) or leaves alone: the base check does not read their state beforehand; `prove_state` proves
            them whole afterwards.
        fingerprints: each patched layer's state right after the patch (`prove_state`).
        checksums: (data pointer, bytes) -> the `layer_state` checksum of each host tensor the patch wrote whole,
            taken as its bytes were proved (`_prove_written`).
        check_finite: refuse a NaN or Inf the chain leaves where a v2 link's differences were added (its values
            are known only once added to the engine's: the reload then fails, and is rolled back;
            `patch_writes`).
    """

    sites: dict[str, list[PatchSite]] = field(default_factory=dict)
    links: dict[str, tuple[Delta, ...]] = field(default_factory=dict)
    not_patched: dict[str, str] = field(default_factory=dict)
    patched: list[str] = field(default_factory=list)
    read_bytes: int = 0
    seconds: float = 0.0
    samples: dict[str, str] = field(default_factory=dict)
    previous: dict[str, LayerRecord] = field(default_factory=dict)
    proved_after: set[str] = field(default_factory=set)
    fingerprints: dict[str, object] = field(default_factory=dict)
    checksums: dict[tuple[int, int], int] = field(default_factory=dict)
    check_finite: bool = True

    @property
    def layers(self) -> set[str]:
        """The layers planned to be patched in place (not handed to vLLM)."""
        return set(self.sites)

    @classmethod
    def plan(cls, model: torch.nn.Module, chain: DeltaChain, engine_stream: list[PlannedTensor],
             held: Mapping[str, int], records: LayerRecords, covers: Mapping[str, list[str]],
             derived, never: Iterable[str] = (), check_finite: bool = True) -> DeltaPatch:
        """Decide, before anything changes, which layers are patched in place and where each tensor lies.

        Args:
            model: the engine's model.
            chain: the delta's links, oldest first.
            engine_stream: this rank's tensors, parents in engine names.
            held: layer -> the link whose base its record names (`delta_base.held_steps`; `check_delta_base`
                proves it, or refuses the delta, before the engine is touched).
            records: this worker's records.
            covers: layer -> the modules whose state its record covers (itself, and modules sharing its storage).
            derived: the engine's derived buffers (`derived_state.DerivedState`).
            never: layers that must be handed to vLLM whatever holds.
            check_finite: see `check_finite`.
        """
        modules = dict(model.named_modules())
        packed = getattr(model, "packed_modules_mapping", None) or {}
        groups: dict[str, list[PlannedTensor]] = {}
        for item in engine_stream:
            if item.parent is not None:
                groups.setdefault(item.parent, []).append(item)
        out, never = cls(check_finite=check_finite), set(never)
        for layer, items in groups.items():
            links = chain.links[held[layer]:] if layer in held else ()
            patched = [item for item in items if any(item.entry.name in link.patches for link in links)]
            if not patched:
                continue  # unchanged by every link it takes: skipped as unchanged, or loaded as it is
            why = not_patchable(layer, modules, covers.get(layer, [layer]), derived, never)
            sites = [] if why is None else None
            for item in patched if sites is not None else ():
                site, why = find_site(item, items, modules, packed, records.get(layer))
                if site is None:
                    sites = None
                    break
                sites.append(site)
            if sites is None:
                out.not_patched[layer] = why
                continue
            out.sites[layer], out.links[layer], out.previous[layer] = sites, links, records.get(layer)
            if not _partly_written(sites, modules):
                out.proved_after.add(layer)
        return out

    def keep_only(self, layers: set[str]) -> None:
        """Patch only LAYERS (those proved to hold a step of the chain: `delta_base.layers_holding_a_base`); the
        others go through vLLM's reload, rebuilt from the base's files."""
        for layer in [name for name in self.sites if name not in layers]:
            del self.sites[layer], self.links[layer], self.previous[layer]
            self.proved_after.discard(layer)
            self.not_patched[layer] = "it is not proved to hold a step of the delta's chain"

    def apply(self, modules: Mapping[str, torch.nn.Module], records: LayerRecords,
              on_layer: Callable[[str], None] | None = None, on_host: bool = True) -> None:
        """Patch every planned layer in place, each tensor then proved to hash to the step's digest.

        Each layer's record is dropped before it is written (a failure leaves it to the rollback). A layer's proof
        runs in a second thread while the next layer is written (`proof_thread`): on a CPU beside the engine's where
        one is spare (`cpu_placement`), or, for a model not ON_HOST, wherever (the write is the device's, the
        proof the host's); so does decoding the next layer's v2 chunks (`decode_ahead`). ON_LAYER is called for
        each layer once every proof passed.

        Raises:
            LayerwiseError: a patched tensor does not hash to the step's digest (corrupt delta): the reload fails.
        """
        start = time.perf_counter()
        inline = decode_ahead_disabled()
        try:
            with ProofThread(spare_cpus(), anywhere=not on_host) as proofs, \
                    DecodeAhead(list(self.sites), self._decode_layer, set() if inline else spare_cpus(),
                                anywhere=not (on_host or inline)) as ahead:
                for layer, sites in self.sites.items():
                    decoded = ahead.take(layer)  # the next layer's v2 chunks decode meanwhile, beside the engine
                    records.drop(layer)
                    for site in sites:
                        self._write(site, modules, self.links[layer], decoded)
                    self.patched.append(layer)
                    # Proved beside the engine's core while the next layer is written (one pass over memory each).
                    proofs.submit(layer, self._prove_written, sites, modules, self.links[layer],
                                  written_mark(sites[0].region(modules).device))
                for layer in proofs.results():
                    if on_layer is not None:
                        on_layer(layer)
        finally:
            self.seconds += time.perf_counter() - start

    def prove_state(self, fingerprints: Callable[[list[str], Mapping], Mapping[str, object]]) -> None:
        """Right after `apply`: take each patched layer's state, and prove the layers the base check did not read.

        FINGERPRINTS(layers, checksums): their states (`LayerSkip._fingerprints`), with the checksums of
        the host tensors `apply` wrote whole, taken in the pass that proved them (`checksums`), not read again.

        For a layer in `proved_after`, every engine tensor the patch did not write must be as its record says it
        was right after its step was loaded (the same storage and checksum, the same kernel handles), and every
        tensor it wrote keeps its storage, dtype and shape; what it wrote hashed to the step's digests (`apply`).
        Together: the layer holds the full step, whatever its state was before.

        Raises:
            LayerwiseError: a tensor the patch left alone changed since layerwise loaded it (something else
                wrote the engine): the reload fails, and is rolled back.
        """
        self.fingerprints = dict(fingerprints(list(self.patched), self.checksums))
        for layer in self.patched:
            if layer not in self.proved_after:
                continue
            written = {f"{site.module}.{site.attribute}" for site in self.sites[layer]}
            changed = _changed_parts(self.previous[layer].fingerprint, self.fingerprints[layer], written)
            if changed:
                raise LayerwiseError(f"layer {layer}: {changed} changed since layerwise loaded the delta's base "
                                     "into it (something else wrote the engine); it does not hold the base")

    def _decode_layer(self, layer: str) -> dict[tuple[str, int], list]:
        """Every v2 chunk LAYER's links patch, decoded (`patch_writes.decode_chunks`).

        Raises:
            LayerwiseError: a chunk is corrupt (`Delta.changes`).
        """
        out = {}
        for site in self.sites[layer]:
            out.update(decode_chunks(site.entry.name, site.entry.dtype, self.links[layer]))
        return out

    def _write(self, site: PatchSite, modules: Mapping[str, torch.nn.Module], links: tuple[Delta, ...],
               decoded: Mapping[tuple[str, int], list]) -> None:
        """Write every link's new values of SITE's tensor at their positions, in place (DECODED: its v2 chunks,
        `_decode_layer`).

        Raises:
            LayerwiseError: the chain leaves a NaN or Inf where a v2 link wrote (`check_finite`).
        """
        self.read_bytes += write_links(site.entry.name, site.region(modules), links, decoded,
                                       check_finite=self.check_finite)

    def _prove_written(self, sites: list[PatchSite], modules: Mapping[str, torch.nn.Module],
                       links: tuple[Delta, ...], written=None) -> None:
        """Each site of a layer must now hash to the step's digest of its tensor; one pass over the engine's bytes.

        An engine tensor on the host that the sites cover whole gets its `layer_state` checksum in the same pass
        (`checksums`), for `prove_state`. WRITTEN (`proof_thread.written_mark`) is waited for first: the device has then
        done the writes queued on the engine thread's stream, whichever thread proves them.

        Raises:
            LayerwiseError: a site's bytes are not the step's tensor (a corrupt delta).
        """
        if written is not None:
            written.synchronize()
        by_tensor: dict[tuple[str, str], list[PatchSite]] = {}
        for site in sites:
            by_tensor.setdefault((site.module, site.attribute), []).append(site)
        for (module, attribute), shares in by_tensor.items():
            shares.sort(key=lambda site: site.offset)
            tensor = stored(modules[module], attribute)
            whole = tensor.device.type == "cpu" and _covers(shares, tensor.numel())
            checksum = xxhash.xxh3_64() if whole else None
            for site in shares:
                entry, raw = site.entry, _host_bytes(site.region(modules))
                hasher = TensorHasher(entry.dtype, entry.shape)
                for at in range(0, len(raw), _PROOF_CHUNK):
                    chunk = raw[at:at + _PROOF_CHUNK]
                    hasher.update(chunk)
                    if checksum is not None:
                        checksum.update(chunk)
                if hasher.hexdigest() != links[-1].step_digests[entry.name]:
                    raise LayerwiseError(f"tensor {entry.name}: patched in place in {module}.{attribute}, its bytes "
                                         "do not hash to the step's digest (corrupt delta)", where=str(links[-1].path))
                self.samples[entry.name] = sample_digest(entry.dtype, entry.shape, len(raw),
                                                         lambda at, n, raw=raw: raw[at:at + n])
            if checksum is not None:
                self.checksums[(tensor.data_ptr(), tensor.numel() * tensor.element_size())] = checksum.intdigest()

    def record(self, records: LayerRecords, groups: Mapping[str, list[str]], fingerprints: Mapping[str, object], *,
               checked: bool) -> None:
        """After a successful reload: each patched layer recorded as holding the step, with its state now.

        Args:
            records: this worker's records.
            groups: layer -> its tensors' names.
            fingerprints: patched layers' states taken again since `prove_state` (those enclosing a layer
                vLLM reloaded after the patch); the others' are `prove_state`'s.
            checked: the new values passed the NaN/Inf check.
        """
        fingerprints = {**self.fingerprints, **fingerprints}
        for layer in self.patched:
            links, names = self.links[layer], groups[layer]
            step = links[-1].step_digests
            before = self.previous[layer]
            samples = {name: self.samples.get(name, before.samples.get(name)) for name in names}
            records.set(layer, replace(before, digest=layer_digest({name: step[name] for name in names}),
                                       fingerprint=fingerprints[layer], checked=before.checked and checked,
                                       samples={k: v for k, v in samples.items() if v is not None}))


def _covers(shares: list[PatchSite], numel: int) -> bool:
    """Whether SHARES (sorted by offset) lie end to end over a whole tensor of NUMEL elements."""
    end = 0
    for site in shares:
        if site.offset != end:
            return False
        end += site.entry.numel
    return end == numel


def _partly_written(sites: list[PatchSite], modules: Mapping[str, torch.nn.Module]) -> bool:
    """Whether some engine tensor holds both a patched tensor and bytes no site covers (a fused tensor whose other
    shares no link changes): its state cannot be proved whole after the patch, only read before it."""
    covered: dict[tuple[str, str], int] = {}
    for site in sites:
        key = (site.module, site.attribute)
        covered[key] = covered.get(key, 0) + site.entry.numel
    return any(numel != stored(modules[module], attribute).numel() for (module, attribute), numel in covered.items())


def _changed_parts(before: object, after: object, written: set[str]) -> str | None:
    """What of a layer's state (`layer_state` fingerprints) differs between BEFORE and AFTER, besides the checksums
    of the tensors the patch WROTE; None when nothing."""
    if not (isinstance(before, tuple) and isinstance(after, tuple)) or len(before) != len(after):
        return "its set of tensors"
    for old, new in zip(before, after, strict=True):
        if old == new:
            continue
        same_tensor = len(old) == len(new) == 5 and old[0] == new[0] and old[1:4] == new[1:4]
        if same_tensor and new[0] in written:
            continue  # written by the patch, in place: its bytes were proved against the step's digest
        return str(old[0])
    return None


def _host_bytes(region: torch.Tensor):
    """The run's raw bytes as a numpy uint8 array: in place on the CPU, copied from any other device."""
    flat = region.view(torch.uint8)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()
