"""A training run's steps under a URL prefix (`s3://bucket/run/`): found by listing, each pinned to its objects.

The store counterpart of `steps.py`'s local directories: a step is the objects under `RUN/<name>/`, `<name>`
matching the step patterns (`step_*`, ...) and holding an integer. One listing of the run prefix (obstore's
`list`, recursive, paginated) gives every step's objects with their ETags and sizes; nothing else is read until a
step is checked. A step the watch loads is pinned (`StoreStep.pinned`): the ETags of the objects its check read
(config, index, shards), as `store.headers.store_pin` names them; every later read of the step names them, so a
step rewritten after it was pinned is refused, never mixed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from layerwise_cli.checkpoint.delta.format import DELTA_FILE
from layerwise_cli.checkpoint.delta.source import open_store_step
from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.format.layout import natural_key
from layerwise_cli.checkpoint.steps.local import AUTO, DEFAULT_PATTERNS, step_number
from layerwise_cli.checkpoint.store.headers import read_store_headers, store_pin
from layerwise_cli.checkpoint.store.objects import StoreSource, display_url, identity_of, open_store, store_error
from layerwise_cli.errors import LayerwiseError

# A step's check reads headers while the watch polls: a few quick retries, not a fetch's patience.
_CHECK_POLICY = FetchPolicy(stall_s=30.0, retries=2, backoff_s=0.5)
Objects = tuple[tuple[str, str, int], ...]  # (path under the step, identity, size), sorted by path


@dataclass(frozen=True)
class StoreStep:
    """One step under a run's URL prefix, as one listing saw it.

    Attributes:
        name: the step's folder name under the run prefix (also the servers' weight version).
        number: its step number (the last integer in the name).
        url: the step's URL (`s3://bucket/run/step_120`): what every target reloads.
        objects: every object under the step, as listed: (path under the step, ETag, size), sorted.
        pinned: the objects a check read and the reload reads (config, index, shards), as (path, ETag, size);
            None until a check pinned the step (then `revision` is their pin).
    """

    name: str
    number: int
    url: str
    objects: Objects
    pinned: Objects | None = None
    # A delta step's pin covers its whole chain (`delta.remote`): set by its check, None for a full step.
    chain_pin: str | None = None

    @property
    def source(self) -> str:
        """What a target reloads: the step's URL."""
        return self.url

    @property
    def revision(self) -> str | None:
        """The pin every target reads the step at (`etags:<16 hex>`), None until a check pinned it."""
        if self.chain_pin is not None:
            return self.chain_pin
        return None if self.pinned is None else store_pin({path: (etag, size) for path, etag, size in self.pinned})

    def names(self) -> list[str]:
        """The paths of the step's objects (a marker is one of them)."""
        return [path for path, _, _ in self.objects]

    def signature(self) -> Objects:
        """What changes whenever an object under the step does: every path, ETag and size."""
        return self.objects

    def examine(self) -> tuple[str | None, StoreStep | None]:
        """Why the step is not (yet) a complete checkpoint, or None and the step pinned at what was read.

        Complete: its config (if any), its index and every shard the index names (or its one
        `model.safetensors`) are there, every header valid and as long as its object, the index naming exactly
        the tensors the shards hold (`read_store_headers`), and each object read still the one listed.
        """
        if DELTA_FILE in self.names():
            return self._examine_delta()
        try:
            found = read_store_headers(StoreSource(self.url, policy=_CHECK_POLICY))
        except LayerwiseError as exc:
            return exc.what, None
        listed = {path: (etag, size) for path, etag, size in self.objects}
        moved = changed_objects(found.pinned, listed)
        if moved:
            return f"{moved[0]} changed since it was listed", None
        pinned = tuple(sorted((path, etag, size) for path, (etag, size) in found.pinned.items()))
        return None, replace(self, pinned=pinned)

    def _examine_delta(self) -> tuple[str | None, StoreStep | None]:
        """`examine` for a delta step: its chain resolved (its base beside it, back to a full step) and pinned as
        one; the step's own objects must be those listed."""
        try:
            step = open_store_step(self.url)
        except LayerwiseError as exc:
            return exc.what, None
        prefix = f"{self.name}/"
        own = {path[len(prefix):]: value for path, value in (step.pinned or {}).items() if path.startswith(prefix)}
        moved = changed_objects(own, {path: (etag, size) for path, etag, size in self.objects})
        if moved:
            return f"{moved[0]} changed since it was listed", None
        pinned = tuple(sorted((path, etag, size) for path, (etag, size) in own.items()))
        return None, replace(self, pinned=pinned, chain_pin=step.revision)

    def excuse(self) -> tuple[str | None, bool]:
        """Why a failed reload of this step is not its fault, and whether it is gone for good.

        One listing of the step. Deleted: not its fault, and it leaves the run's listing by itself. Rewritten
        since it was pinned (an object of the pin changed or went): not its fault, gone for good (never tried
        again under this name). The store not answering: not its fault, tried again.
        """
        try:
            now = {path: (etag, size) for path, etag, size in list_objects(self.url)}
        except LayerwiseError as exc:
            return f"the store did not answer whether the step is still there ({exc.what})", False
        if not now:
            return "the step was deleted while it was loading", False
        if self.pinned is not None:
            moved = changed_objects({path: (etag, size) for path, etag, size in self.pinned}, now)
            if moved:
                return f"{self.url}: {moved[0]} changed since the step was pinned ({self.revision})", True
        return None, False

    def deletion_refusal(self, marker: str) -> str | None:
        """Why `--keep` must leave the step where it is (not a complete step this watch would load), or None."""
        if marker != AUTO and marker in self.names():
            return None
        problem, _ = self.examine()
        return None if problem is None else f"not a complete checkpoint: {problem}"


def changed_objects(pinned: Mapping[str, tuple[str, int]], now: Mapping[str, tuple[str, int]]) -> list[str]:
    """The paths of PINNED whose (ETag, size) NOW differs, or that NOW lacks, in sorted order."""
    return sorted(path for path, value in pinned.items() if now.get(path) != value)


def steps_in_listing(url: str, listing: Iterable[tuple[str, str, int]],
                     patterns: Iterable[str] = DEFAULT_PATTERNS) -> list[StoreStep]:
    """Group a run prefix's objects (path under URL, ETag, size) into steps, oldest first.

    A step is the first path component of its objects: its name matches one of PATTERNS and holds an integer.
    Objects right under the run prefix, and folders that are no step, are ignored.
    """
    patterns = tuple(patterns)
    grouped: dict[str, list[tuple[str, str, int]]] = {}
    for path, etag, size in listing:
        folder, sep, rest = path.partition("/")
        if sep and rest and any(fnmatch.fnmatchcase(folder, p) for p in patterns):
            grouped.setdefault(folder, []).append((rest, etag, size))
    base = url.rstrip("/")
    steps = [StoreStep(name, number, f"{base}/{name}", tuple(sorted(objects)))
             for name, objects in grouped.items() if (number := step_number(name)) is not None]
    return sorted(steps, key=lambda s: (s.number, natural_key(s.name)))


def list_objects(url: str) -> list[tuple[str, str, int]]:
    """Every object under URL (recursive, every page): (path under URL, ETag, size).

    Raises:
        LayerwiseError: one line naming the URL: no such bucket, access denied, the store not reachable.
    """
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    store = open_store(url.rstrip("/"), _CHECK_POLICY)
    found = []
    try:
        for page in obstore.list(store, chunk_size=1000):
            found.extend((str(meta["path"]), identity_of(meta), int(meta["size"])) for meta in page)
    except Exception as exc:
        raise store_error(exc, display_url(url)) from exc
    return found


def list_store_steps(url: str, patterns: Iterable[str] = DEFAULT_PATTERNS) -> list[StoreStep]:
    """List the run prefix URL afresh (one listing, every page) and return its steps, oldest first.

    Raises:
        LayerwiseError: one line naming the URL (`list_objects`).
    """
    return steps_in_listing(url, list_objects(url), patterns)


def delete_step(step: StoreStep) -> None:
    """Delete every object under STEP's prefix, as listed now (bulk deletes where the store has them).

    Raises:
        LayerwiseError: one line naming the step: access denied (the store does not allow deletes), or the
            store's own failure.
    """
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    paths = [path for path, _, _ in list_objects(step.url)]
    if not paths:
        return
    store = open_store(step.url.rstrip("/"), _CHECK_POLICY)
    try:
        obstore.delete(store, paths)
    except Exception as exc:
        raise store_error(exc, display_url(step.url)) from exc
