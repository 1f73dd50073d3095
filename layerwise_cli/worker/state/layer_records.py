"""What a worker remembers about the layers it reloaded, and the decision to skip an unchanged one.

Every worker keeps, in its own process memory, one `LayerRecords`: per parent
layer it reloaded (the engine's module name on this rank), the layer digest of
the source bytes that produced it (`checkpoint.digests.layer_digest`), the
fingerprint of the layer's state taken right after the reload
(`worker.layer_state`), whether the NaN/Inf check ran on those bytes, and
the sample digest of each of its tensors (`checkpoint.samples`). An
id made once per worker process names the record: a restarted engine has a
new id and no record.

A layer is skipped on the next reload only when all of these hold: the reload
does not ask for every layer (`all_layers`); the record exists; its digest
equals the new source's layer digest; its fingerprint equals the layer's
fingerprint now (nothing else wrote the layer since); either the record's
bytes were checked for NaN/Inf or this reload does not check either; and, when
the new digest is a header's claim rather than hashed from the bytes, the
sampled bytes of every tensor in the file equal the record's samples
(`worker.spot_check`): a header rewritten with old `__metadata__` never skips. A record
is dropped as soon as its layer is handed to vLLM and set again only when the
reload succeeded, so a failed or rolled-back reload leaves no record of the
layers it touched.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from layerwise_cli.worker.state.worker_state import kept_on

REASON_UNCHANGED = "unchanged"


@dataclass(frozen=True)
class LayerRecord:
    """One parent layer as layerwise last loaded it on this worker."""

    # The layer digest of the source bytes loaded; None when they were not hashed (no header digests, and the
    # samples showed the layer changed): such a record never allows a skip, and the next reload whose samples
    # match hashes the layer and records its digest.
    digest: str | None
    fingerprint: object  # the layer's state right after the reload (compared with ==)
    checked: bool  # the bytes passed the NaN/Inf check
    # Tensor name -> sample digest of the bytes loaded (`checkpoint.samples`): what a header digest is checked by.
    samples: Mapping[str, str] = field(default_factory=dict)


class LayerRecords:
    """A worker's records, keyed by engine module name; `engine_id` is new in every worker process."""

    def __init__(self) -> None:
        self.engine_id = uuid.uuid4().hex
        self._records: dict[str, LayerRecord] = {}

    def get(self, name: str) -> LayerRecord | None:
        return self._records.get(name)

    def set(self, name: str, record: LayerRecord) -> None:
        self._records[name] = record

    def drop(self, name: str) -> None:
        self._records.pop(name, None)

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, name: object) -> bool:
        return name in self._records


_ATTRIBUTE = "_layerwise_records"


def records_of(worker) -> LayerRecords:
    """The worker's records, made on first use (the worker extension instance lives as long as the process)."""
    return kept_on(worker, _ATTRIBUTE, LayerRecords)


@dataclass
class SkipDecider:
    """Which layers of one reload may be skipped; built before the engine is touched.

    Args (fields):
        records: the worker's records.
        known: layer -> its digest from the shard headers, or None when the
            bytes must be hashed as they are read.
        fingerprint_now: layers -> their fingerprints now (called once, for
            the layers whose record could allow a skip).
        all_layers: reload everything (never skip).
        checks_finite: this reload refuses NaN/Inf (then only records whose
            bytes were checked allow a skip).
        never: layers handed over whatever their records say (`rerun_hooks`).
    """

    records: LayerRecords
    known: Mapping[str, str | None]
    fingerprint_now: Callable[[list[str]], Mapping[str, object]]
    all_layers: bool = False
    checks_finite: bool = True
    never: frozenset[str] = frozenset()
    # Filled in __post_init__: layer -> the recorded digest it may be skipped for.
    trusted: dict[str, str] = field(default_factory=dict, init=False)
    # Layers whose source digest equals their record's but whose state changed since (something else wrote
    # them): reloaded, where a skip would have been wrong.
    stale: list[str] = field(default_factory=list, init=False)
    # Recorded digests of layers whose state changed, for layers whose digest is known only once read.
    _changed: dict[str, str] = field(default_factory=dict, init=False)
    # Layers whose fingerprint was taken to decide.
    fingerprinted: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.all_layers:
            return
        candidates = []
        for name, digest in self.known.items():
            record = self.records.get(name)
            if name in self.never or record is None or record.digest is None or (
                    self.checks_finite and not record.checked):
                continue
            if digest is not None and digest != record.digest:
                continue  # changed in the source: reloaded, no need to look at the engine
            candidates.append(name)
        if not candidates:
            return
        now = self.fingerprint_now(candidates)
        self.fingerprinted = len(candidates)
        for name in candidates:
            record = self.records.get(name)
            if record is not None and now.get(name) == record.fingerprint:
                self.trusted[name] = record.digest
            elif record is not None and self.known.get(name) is not None:
                self.stale.append(name)
            elif record is not None:
                self._changed[name] = record.digest

    def skip_before_reading(self) -> set[str]:
        """Layers the header digests would skip without streaming them (`worker.spot_check` checks them first)."""
        return {name for name, digest in self.known.items() if digest is not None and self.trusted.get(name) == digest}

    def skip_after_reading(self, name: str, digest: str) -> bool:
        """Whether a layer whose digest was computed from its bytes as they were read is skipped."""
        if self._changed.get(name) == digest:
            self.stale.append(name)
        return self.trusted.get(name) == digest
