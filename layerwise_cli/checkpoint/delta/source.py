"""A delta opened as the full step it rebuilds: the base's headers with the step's digests, read through the patch.

A delta's base may itself be a delta (a chain: step 120 against 119, 119 against 118, ..., back to a full
step): the step is then rebuilt from the full step at the chain's start through every patch in order, each
link proved by its digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.format import VALUES_SUFFIX, WHOLE, WHOLE_SUFFIX, Delta
from layerwise_cli.checkpoint.delta.hub_run import is_hub_step, open_hub_step
from layerwise_cli.checkpoint.delta.read import delta_file, read_delta
from layerwise_cli.checkpoint.delta.remote import open_store_chain
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.digests import checkpoint_digests, digests_metadata
from layerwise_cli.checkpoint.format.finite import nonfinite_elements
from layerwise_cli.checkpoint.format.layout import read_json
from layerwise_cli.checkpoint.sources import Checkpoint, looks_like_repo_id, open_checkpoint
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.errors import LayerwiseError


def is_remote_step(source: str) -> bool:
    """Whether SOURCE is a step read by range at a pin, perhaps the last link of a delta chain: a store URL or a
    Hub run's step (`hf://org/run/step_120`). `open_step` opens it in place, from this host's copies of what it
    fetched; nothing is downloaded whole."""
    return is_store_url(source) or is_hub_step(source)


def open_step(source: str, revision: str | None = None) -> Checkpoint:
    """`open_checkpoint`, except that a sparse delta (local, or a step folder by URL) is opened as the full step
    it rebuilds.

    For the callers that read tensors through `Checkpoint.delta` (a reload, its pre-flight, `--verify`);
    everything else opens a delta as the safetensors file it is. A delta by URL (`delta.remote`) is read from
    this host's store cache, its chain pinned as one (`revision` is that pin; REVISION, when given, must equal it).
    """
    if is_store_url(source):
        return open_store_step(source, revision)
    if is_hub_step(source):
        return open_hub_run_step(source, revision)
    if not looks_like_repo_id(source) and delta_file(source) is not None:
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        return open_delta_checkpoint(source)
    return open_checkpoint(source, revision)


def open_store_step(url: str, revision: str | None = None) -> Checkpoint:
    """The step at URL: a delta step's chain resolved (`remote.open_store_chain`) and opened as the full step it
    rebuilds, from this host's copies; a full step as `open_checkpoint` reads it (by range, at REVISION).

    The result's `revision` is the chain's pin, `pinned` every object of the chain, `kind` "store", and its
    `local_dir` the full step's folder of links in the store cache: a reload reads it as a local run.
    """
    chain = open_store_chain(url, revision, MAX_CHAIN)
    if chain is None:
        return open_checkpoint(url, revision)
    step = chain.base
    for link in chain.links:
        step = delta_over_base(link.delta, step, display_url(step.source), link.url)
    assert step.delta is not None
    return replace(step, kind="store", revision=chain.pin, pinned=chain.pinned,
                   delta=replace(step.delta, fetched_bytes=chain.fetched_bytes))


def open_hub_run_step(source: str, revision: str | None = None) -> Checkpoint:
    """The step folder of a run pushed to a Hub repo (`hf://org/run/step_120`) at REVISION's commit, from the
    Hub cache (`hub_run.open_hub_step`): a delta step opened as the full step it rebuilds, its chain read at the
    same commit; a full step as its folder. `commit` and `revision` are the commit."""
    base, deltas, fetched = open_hub_step(source, revision, MAX_CHAIN)
    step = base
    for i, delta in enumerate(deltas):
        link = source if i == len(deltas) - 1 else str(delta.path.parent)
        step = delta_over_base(delta, step, step.source, link)
    if step.delta is None:
        return replace(step, source=source)
    return replace(step, delta=replace(step.delta, fetched_bytes=fetched))


# Links a chain of deltas may have before its full step: beyond it, a loop (or a run that never wrote a full step).
MAX_CHAIN = 100


@dataclass(frozen=True)
class DeltaChain:
    """The deltas a step is rebuilt through, oldest first: the first applies to a full step, each later one to
    the step before it. What a reload says of "the delta" is its last link's (its base, patches, file).

    Attributes:
        links: the deltas, oldest first.
    """

    links: tuple[Delta, ...]
    # The bytes fetched to open it (a chain by URL: its delta files, and a base this host did not hold).
    fetched_bytes: int = 0
    # The checks it passed (`validate`, `refuse_nonfinite`): a pinned chain a pre-flight checked is not decoded
    # again by the reload that takes it (`worker/state/prepared.py`).
    passed: set[str] = field(default_factory=set, compare=False, repr=False)

    @property
    def last(self) -> Delta:
        return self.links[-1]

    @property
    def path(self) -> Path:
        return self.last.path

    @property
    def header(self):
        return self.last.header

    @property
    def base_location(self) -> str:
        return self.last.base_location

    @property
    def base_digests(self):
        return self.last.base_digests

    @property
    def step_digests(self):
        return self.last.step_digests

    @property
    def patches(self):
        return self.last.patches

    def patch_nbytes(self, name: str) -> int:
        """The bytes of tensor NAME's patches in every link (positions and values, or the whole tensor)."""
        return sum(link.patch_nbytes(name) for link in self.links)

    def validate(self) -> None:
        """Every link's positions (`Delta.validate`)."""
        if "validate" in self.passed:
            return
        for link in self.links:
            link.validate()
        self.passed.add("validate")

    def decode_chunks(self) -> None:
        """Decode every v2 chunk of every link (`Delta.changes`): a corrupt stream is found here, not only when
        applied (`inspect-order --scan`; a reload's pre-flight reads only the frames' headers)."""
        for link in self.links:
            for name, patch in link.patches.items():
                if patch.kind == SPARSE:
                    for _ in link.changes(name):
                        pass

    def refuse_nonfinite(self) -> None:
        """Refuse a NaN or Inf the rebuilt step would hold: among the last link's new values, or an earlier
        link's that no later link rewrites (`Delta.refuse_nonfinite` names the link and tensor).

        An RL run that wrote a NaN step goes on with a step written against it (the trainer's next save,
        `base=` the step before): that step rebuilds through the NaN link, whose non-finite values its own
        patch replaces. Refusing every link's NaN would refuse each later step of the run for good.
        """
        if "refuse_nonfinite" in self.passed:
            return
        self.last.refuse_nonfinite()
        for at, link in enumerate(self.links[:-1]):
            try:
                link.refuse_nonfinite()
            except LayerwiseError as refusal:
                if any(self._left_nonfinite(at, name) for name in link.patches):
                    raise LayerwiseError(f"{refusal.what}; no later step of its chain rewrites them",
                                         where=refusal.where) from None
        self.passed.add("refuse_nonfinite")

    def _left_nonfinite(self, at: int, name: str) -> bool:
        """Whether link AT stores a NaN or Inf value of tensor NAME at a position no later link rewrites."""
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        link = self.links[at]
        patch = link.patches[name]
        if patch.kind == SPARSE:
            return False  # differences, no values: the rebuilt or patched values are checked as they are made
        values = link.raw(name + (WHOLE_SUFFIX if patch.kind == WHOLE else VALUES_SUFFIX))
        bad = nonfinite_elements(values, patch.dtype)
        if bad is None or not bad.size:
            return False
        left = link.positions(name)[bad]
        for later in self.links[at + 1:]:
            rewrite = later.patches.get(name)
            if rewrite is not None:
                if rewrite.kind == WHOLE:
                    return False
                left = left[~np.isin(left, later.positions(name), assume_unique=True)]
        return bool(left.size)


def base_directory(delta: Delta) -> Path:
    """Where the delta's base is now: its recorded location, else a sibling of the delta's step of that name.

    Raises:
        LayerwiseError: neither exists (naming both).
    """
    recorded = Path(delta.base_location)
    if recorded.exists():
        return recorded
    beside = delta.path.parent.parent / recorded.name
    if beside.exists():
        return beside
    raise LayerwiseError(f"its base {delta.base_location} does not exist (nor {beside}): a delta is rebuilt from "
                         "its base step's files", where=str(delta.path))


def open_delta_checkpoint(path: str | Path, *, _links: int = 0) -> Checkpoint:
    """The full step a delta rebuilds, as a `Checkpoint`: what a reload plans, pre-flights and streams.

    Its shards are those of the full step at the start of its chain (`local_dir` is that step's directory),
    their headers carrying this step's digests (`layerwise.digests`), so that the skip of unchanged layers and
    the records work as for a full step; `delta` is the `DeltaChain` every read goes through
    (`rebuilt_tensor`). The base (a full step, or a delta opened the same way) must hold exactly the delta's
    tensors, with the delta's base digests where its headers carry digests.

    Raises:
        LayerwiseError: the delta or its base cannot be read, the base is not the delta's base, or the chain
            is longer than `MAX_CHAIN` links (a loop).
    """
    delta = read_delta(path)
    if _links >= MAX_CHAIN:
        raise LayerwiseError(f"a chain of more than {MAX_CHAIN} deltas (a loop?): no full step at its start",
                             where=str(delta.path))
    base_dir = base_directory(delta)
    if delta_file(base_dir) is not None:
        base = open_delta_checkpoint(base_dir, _links=_links + 1)
    else:
        base = open_checkpoint(str(base_dir))
    return delta_over_base(delta, base, str(base_dir), str(path))


def delta_over_base(delta: Delta, base: Checkpoint, base_where: str, source: str) -> Checkpoint:
    """The full step DELTA rebuilds from BASE (a full step, or a delta opened as its step), as a `Checkpoint`.

    Wherever the files came from (a local run, or a store's objects kept in this host's cache:
    `delta.remote`), the rule is one: the base must hold exactly the delta's tensors, with the delta's base
    digests where its headers carry digests, and each patched tensor's dtype and shape.

    Args:
        delta: the delta read (`read_delta`).
        base: its base, opened.
        base_where: how messages name the base (its directory or URL).
        source: the `source` of the result (the delta step as the caller named it).

    Raises:
        LayerwiseError: the base is not the delta's base.
    """
    where = str(delta.path)
    names = {t.name: t for t in base.tensors}
    odd = sorted(set(names) ^ set(delta.base_digests))
    if odd:
        raise LayerwiseError(f"its base {base_where} is not the delta's base: tensor {odd[0]} is in only one of "
                             "them", where=where)
    claimed = checkpoint_digests(base.shards) or {}
    for name, digest in claimed.items():
        if digest != delta.base_digests[name]:
            raise LayerwiseError(f"its base {base_where} is not the delta's base: tensor {name} differs (header "
                                 f"digest {digest}, the delta's base {delta.base_digests[name]})", where=where)
    for name, patch in delta.patches.items():
        entry = names[name]
        if (entry.dtype, entry.shape) != (patch.dtype, patch.shape):
            raise LayerwiseError(f"tensor {name}: the patch is {patch.dtype}{list(patch.shape)}, the base's "
                                 f"{entry.dtype}{list(entry.shape)}", where=where)
    shards = [replace(shard, metadata={**shard.metadata, **digests_metadata(
        {t.name: delta.step_digests[t.name] for t in shard.tensors})}) for shard in base.shards]
    config_path = delta.path.parent / "config.json"
    config = read_json(config_path) if config_path.is_file() else base.config
    links = (base.delta.links if base.delta is not None else ()) + (delta,)
    return replace(base, source=source, shards=shards, config=config, delta=DeltaChain(links))
