"""Delta steps by URL: a run's step folders under one prefix, each delta's base the folder of its name beside it.

A trainer uploads its run folder as it is (`aws s3 cp --recursive run/ s3://bucket/run/`, obstore's `put`, `hf
upload` of the same folders): `s3://bucket/run/step_120/delta.safetensors` names its base `/work/run/step_119`
(wherever the trainer wrote it), and the base is `s3://bucket/run/step_119`, the folder of that name beside
it. A base that is itself a delta is followed the same way, back to the chain's full step.

What crosses the network is what this host does not have yet, each object at the ETag read first: each link's
delta file (and its `config.json`), whole, and the full step's headers; the full step's shards only when this
host's store cache does not already hold them (kept by the reload that loaded that step). Every object is kept
in the store cache under its name, ETag and size (`store.objects.cache_key`), and the step is then read from a
folder of links to them (`snapshots/<pin>/`), exactly as a local run is: the same checks, the same rebuild, the
same patch in place.

The chain is one identity: a pin (`etags:<16 hex>`) of every object read, named by its path under the run
prefix (`step_120/delta.safetensors`, `step_118/model.safetensors`). The client reads it once; every server,
rank, check and rollback reads the chain again and refuses it when the pin differs (an object rewritten, a
base deleted since).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from layerwise_cli.checkpoint.delta.format import DELTA_FILE, Delta
from layerwise_cli.checkpoint.delta.read import base_location_of, first_header_read, read_delta
from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.fetch.range_fetcher import RangeFetcher, spread_parts, whole_files
from layerwise_cli.checkpoint.format.header import read_header_by_range
from layerwise_cli.checkpoint.format.layout import INDEX_NAME
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.checkpoint.store.headers import PIN_PREFIX, store_pin
from layerwise_cli.checkpoint.store.objects import StoreSource, display_url, is_missing, store_cache_folder
from layerwise_cli.errors import LayerwiseError

# Read in pre-flight, before anything is paused: a few quick retries, not a stream's patience.
_OPEN_POLICY = FetchPolicy(stall_s=30.0, retries=2, backoff_s=0.5)
CONFIG = "config.json"
# Connections per object prefix fetching a chain's files (each link's own; links missing together are fetched
# at the same time, `_Links`), and the links fetched at once.
CONNECTIONS = 4
_LINK_FETCHES = 8


@dataclass(frozen=True)
class StoreLink:
    """One delta of a chain by URL: the delta (read from this host's kept copy) and its step's URL."""

    delta: Delta
    url: str


@dataclass(frozen=True)
class StoreChain:
    """A delta step by URL, resolved: its links oldest first, the full step at the chain's start, the pin.

    Attributes:
        links: the deltas, oldest first (the last is the step asked for).
        base: the chain's full step, opened from this host's store cache (`local_dir` the folder of links).
        base_url: the full step's URL.
        pinned: every object read, as `<step folder>/<file>` -> (ETag, size).
        fetched_bytes: the bytes this open fetched (delta files, and shards the cache did not hold).
    """

    links: tuple[StoreLink, ...]
    base: Checkpoint
    base_url: str
    pinned: dict[str, tuple[str, int]]
    fetched_bytes: int

    @property
    def pin(self) -> str:
        """The chain's identity (`store_pin` of every object read): what the operation carries everywhere."""
        return store_pin(self.pinned)


def _delta_step(url: str) -> StoreSource | None:
    """URL's step folder, its delta file's identity read (one HEAD request), or None when it holds none.

    Any failure says no: a missing step, bucket, credentials or store is then named by the full step's reading
    (`open_checkpoint`), as for any URL, never by a delta file the user did not ask for.
    """
    try:
        source = StoreSource(url, policy=_OPEN_POLICY)
        source.metadata(DELTA_FILE)
    except LayerwiseError:
        return None
    return source


def open_store_chain(url: str, revision: str | None, max_links: int) -> StoreChain | None:
    """Resolve the delta step at URL into its chain, or None when URL is not a delta step (a full step).

    The chain is walked once: a link this host keeps is read from its copy; one it lacks is fetched whole in
    the background while its base is read from its header by range, so the links a host missed are fetched at
    the same time, each over its own connections (`_Links`).

    Args:
        url: the step's URL (`s3://bucket/run/step_120`).
        revision: the pin an earlier step of the operation read (`StoreChain.pin`); None: this open pins.
        max_links: links allowed before the chain's full step (beyond it: a loop).

    Raises:
        LayerwiseError: one line naming the step: a base that is not there (never uploaded, or deleted), a
            delta that cannot be read, a chain that loops, objects changed since REVISION was read.
    """
    url = url.rstrip("/")
    first = _delta_step(url)
    if first is None:
        return None
    pool = ThreadPoolExecutor(_LINK_FETCHES, thread_name_prefix="layerwise-links")
    links = _Links(pool)
    fetched = 0

    def open_base(base_url: str, child: str) -> Checkpoint:
        nonlocal fetched
        base, fetched = _open_base(base_url, child)
        return base

    try:
        pinned, base, base_url = _walk(first, max_links, links.meet, open_base)
        read = links.read()
    finally:
        # A walk that failed: the fetches not started are dropped, those under way end (each file kept whole).
        pool.shutdown(wait=True, cancel_futures=True)
    chain = StoreChain(tuple(reversed([link for link, _ in read])), base, base_url, pinned,
                       fetched + sum(n for _, n in read))
    if revision is not None and chain.pin != revision:
        raise LayerwiseError(f"the chain's objects changed since this operation pinned them ({revision}, now "
                             f"{chain.pin}), and the store keeps no earlier version to read: refused",
                             where=display_url(url))
    return chain


class _Links:
    """The links of one chain, as its walk meets them (newest first), each read from this host's copy.

    A link the store cache keeps is read at once. One it lacks has its files fetched whole in POOL
    (`kept_folder`, over its own connections) while its base is read from its header by range: the walk goes
    on to the next link meanwhile, so links missing together are fetched at the same time, and `read` waits
    for them.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._met: dict[str, tuple[Future, str]] = {}  # step URL -> (its link being read, its base location)
        self._order: list[Future] = []

    def meet(self, source: StoreSource) -> str:
        """SOURCE's link, read or being fetched; its base location (where the walk goes next)."""
        if source.url in self._met:  # a loop, met again: the walk's count of links stops it, never `read`
            return self._met[source.url][1]
        if source.cached(DELTA_FILE) is not None:
            future: Future = Future()
            future.set_result(_read_link(source))
            location = future.result()[0].delta.base_location
        else:
            future = self.pool.submit(_read_link, source)
            try:
                location = _base_location(source)
            except LayerwiseError:  # the delta's own reading names what is wrong with it, as it always has
                location = future.result()[0].delta.base_location
        self._met[source.url] = (future, location)
        self._order.append(future)
        return location

    def read(self) -> list[tuple[StoreLink, int]]:
        """Each link met (newest first) and the bytes fetched for it, once its fetch is done.

        Raises:
            LayerwiseError: a link's files could not be fetched or kept, or its delta cannot be read.
        """
        return [future.result() for future in self._order]


def store_step_pin(url: str, max_links: int) -> str | None:
    """The pin of the delta step at URL (`StoreChain.pin`), read without fetching a tensor: each link's delta
    header by range, the full step's headers; None when URL is not a delta step.

    What a client resolves once, at the start of an operation, and hands to every server (which open the chain
    from their own caches, `open_store_chain`, and refuse it when the pin differs).

    Raises:
        LayerwiseError: as `open_store_chain`.
    """
    first = _delta_step(url.rstrip("/"))
    if first is None:
        return None
    pinned, _, _ = _walk(first, max_links, _base_location, lambda base_url, child: _remote_base(base_url, child))
    return store_pin(pinned)


def _link_files(source: StoreSource) -> list[str]:
    """The files of a delta step that a host keeps: the delta file, and its `config.json` when there."""
    return [DELTA_FILE] + ([CONFIG] if _exists(source, CONFIG) else [])


def _walk(first: StoreSource, max_links: int, read_link: Callable[[StoreSource], str],
          open_base: Callable[[str, str], Checkpoint]) -> tuple[dict[str, tuple[str, int]], Checkpoint, str]:
    """Follow the chain of FIRST's delta step: READ_LINK each delta step (giving its base location), OPEN_BASE
    the full step at its start; every object read, named by `<step folder>/<file>`, the full step, and its URL.

    Each object is asked about once (a HEAD of each link's delta file and `config.json`, then the full step's
    headers); READ_LINK reads the rest from the same source, pinned.
    """
    pinned: dict[str, tuple[str, int]] = {}
    url = step_url = child = first.url
    links = 0
    source = first
    while True:
        if links and not _holds_delta(source, child):
            break
        if links >= max_links:
            raise LayerwiseError(f"a chain of more than {max_links} deltas (a loop?): no full step at its start",
                                 where=display_url(url))
        _exists(source, CONFIG)  # pinned when there
        location = read_link(source)
        links += 1
        pinned.update(_named(step_url, {name: source.metadata(name) for name in (DELTA_FILE, CONFIG)
                                        if name in source.pinned}))
        child, step_url = step_url, beside(step_url, location)
        source = StoreSource(step_url, policy=_OPEN_POLICY)
    base = open_base(step_url, child)
    pinned.update(_named(step_url, base.pinned or {}))
    return pinned, base, step_url


def _base_location(source: StoreSource) -> str:
    """The base location SOURCE's delta names, from its header read by range (never its patches): one request
    for most headers, a second for the rest of a longer one (`first_header_read`)."""
    where = source.where(DELTA_FILE)
    size = source.metadata(DELTA_FILE)[1]

    def read_range(start: int, end: int) -> tuple[bytes, int]:
        end = min(end, size)
        return (source.read(DELTA_FILE, start, end)[0] if end > start else b""), size

    header, _ = read_header_by_range(read_range, DELTA_FILE, where, first_header_read(size))
    return base_location_of(header, where)


def _remote_base(base_url: str, child: str) -> Checkpoint:
    try:
        return open_checkpoint(base_url)
    except LayerwiseError as exc:
        raise LayerwiseError(f"its base {base_url} is not there or cannot be read ({exc.what}): a delta is "
                             "rebuilt from its base step", where=child) from None


def beside(step_url: str, base_location: str) -> str:
    """The URL of a delta's base: the folder named as the base's last path component, beside the delta's step."""
    name = PurePosixPath(base_location.rstrip("/")).name
    return f"{step_url.rstrip('/').rsplit('/', 1)[0]}/{name}"


def _holds_delta(source: StoreSource, child: str) -> bool:
    """Whether the base folder SOURCE holds a delta (else it is the chain's full step); a folder with no
    objects at all is a missing base, named with the delta CHILD that needs it."""
    try:
        source.metadata(DELTA_FILE)
    except LayerwiseError as exc:
        if is_missing(exc):
            return False
        raise LayerwiseError(f"its base {source.shown} cannot be read ({exc.what})", where=child) from None
    return True


def _read_link(source: StoreSource) -> tuple[StoreLink, int]:
    """The delta of SOURCE's step, read from this host's kept copy (fetched whole first if not kept)."""
    folder, fetched = kept_folder(source, _link_files(source), {})
    try:
        delta = read_delta(folder / DELTA_FILE)
    except LayerwiseError as exc:
        raise LayerwiseError(exc.what, where=source.where(DELTA_FILE)) from None
    return StoreLink(delta, source.url.rstrip("/")), fetched


def _open_base(base_url: str, child: str) -> tuple[Checkpoint, int]:
    """The chain's full step at BASE_URL, opened from this host's store cache (its shards fetched whole when
    the cache does not hold them); a base not there is named with the delta CHILD that needs it."""
    remote = _remote_base(base_url, child)
    source = StoreSource(base_url, pinned=remote.pinned, policy=_OPEN_POLICY)
    shards = [shard.name for shard in remote.shards]
    written = {name: value for name, value in ((CONFIG, remote.config), (INDEX_NAME, remote.index))
               if value is not None}
    folder, fetched = kept_folder(source, shards, written)
    local = open_checkpoint(str(folder))
    return replace(local, source=base_url, kind="store", revision=remote.revision, pinned=remote.pinned), fetched


def kept_folder(source: StoreSource, names: list[str], written: dict[str, dict]) -> tuple[Path, int]:
    """A folder of this host's copies of NAMES under SOURCE (each kept in the store cache at its pinned ETag),
    with the JSON files WRITTEN beside them; and the bytes fetched to fill it (0 when all were kept).

    The folder is `snapshots/<pin of NAMES>/` in the prefix's store cache: links to `blobs/`, made once.

    Raises:
        LayerwiseError: an object cannot be fetched, or the cache cannot keep it (read-only, or held by another
            process filling it).
    """
    sizes = {name: source.metadata(name)[1] for name in names}
    missing = {name: size for name, size in sizes.items() if source.cached(name) is None}
    fetched = 0
    if missing:
        part_bytes = spread_parts(sum(missing.values()), CONNECTIONS)
        with RangeFetcher(source, whole_files(missing), keep=True, connections=CONNECTIONS,
                          part_bytes=part_bytes) as fetcher:
            fetcher.check()
            fetched = fetcher.bytes_fetched
    folder = store_cache_folder(source.url) / "snapshots" / store_pin(
        {name: source.pinned[name] for name in names})[len(PIN_PREFIX):]
    if folder.is_dir():
        return folder, fetched
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    for name in names:
        blob = source.cached(name)
        if blob is None:
            raise LayerwiseError("could not be kept in the store cache (read-only, or being fetched by another "
                                 "process): a delta's base and links are read from this host's copy",
                                 where=source.where(name))
        os.symlink(blob, tmp / name)
    for name, value in written.items():
        (tmp / name).write_text(json.dumps(value))
    try:
        os.rename(tmp, folder)
    except OSError:  # another rank made it first: the same links
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, fetched


def _exists(source: StoreSource, name: str) -> bool:
    try:
        source.metadata(name)
    except LayerwiseError as exc:
        if is_missing(exc):
            return False
        raise
    return True


def _named(step_url: str, pinned: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """PINNED's objects named by their path under the run prefix: `<step folder>/<file>`."""
    step = step_url.rstrip("/").rsplit("/", 1)[-1]
    return {f"{step}/{name}": value for name, value in pinned.items()}
