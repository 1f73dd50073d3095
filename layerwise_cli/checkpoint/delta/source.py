"""A delta opened as the full step it rebuilds: the base's headers with the step's digests, read through the patch.

A delta's base may itself be a delta (a chain: step 120 against 119, 119 against 118, ..., back to a full
step): the step is then rebuilt from the full step at the chain's start through every patch in order, each
link proved by its digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.format import VALUES_SUFFIX, WHOLE, WHOLE_SUFFIX, Delta, unsigned_type
from layerwise_cli.checkpoint.delta.hub_run import is_hub_step, open_hub_step
from layerwise_cli.checkpoint.delta.read import delta_file, read_delta
from layerwise_cli.checkpoint.delta.remote import open_store_chain
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.digests import TensorHasher, checkpoint_digests, digests_metadata, tensor_digest
from layerwise_cli.checkpoint.format.finite import nonfinite_elements
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, TensorEntry
from layerwise_cli.checkpoint.format.layout import read_json
from layerwise_cli.checkpoint.format.samples import sample_digest, sample_spans
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


def rebuilt_bytes(chain: DeltaChain, entry: TensorEntry, raw, where: str, buffers: RebuildBuffers | None = None):
    """Tensor ENTRY's bytes in the step, from its bytes RAW in the chain's full step (a numpy uint8 array); proved.

    Every link's patch is applied in turn, and the result must hash to the step's digest of the tensor (the last
    link's): what comes out is the step's tensor, or nothing. One hash proves it; only when it fails are RAW and
    each link's result hashed again, to say which is wrong (`_why_not_the_step`).

    Args:
        chain: the deltas, oldest first.
        entry: the tensor as the full step's header describes it.
        raw: its bytes there.
        where: the full step's shard file, for the message.
        buffers: buffers for the results (`Delta.apply`), or None for new ones.

    Returns:
        The step's bytes (RAW itself when no link changes the tensor).

    Raises:
        LayerwiseError: RAW is not the chain's base, a patch is corrupt, or a result is not its step's tensor.
    """
    # Otherwise its step digest is its base digest (`read_delta` checks it).
    patching = [link for link in chain.links if entry.name in link.patches]
    if len(patching) == 1 and patching[0].patches[entry.name].kind == SPARSE:
        out, digest = _rebuilt_in_one_pass(patching[0], entry, raw, buffers)
    else:
        out = raw
        for link in patching:
            out = link.apply(entry.name, out, buffers)
        digest = tensor_digest(entry.dtype, entry.shape, out)
    if digest != chain.links[-1].step_digests[entry.name]:
        raise _why_not_the_step(chain, entry, raw, where)
    return out


def rebuilt_sample(chain: DeltaChain, entry: TensorEntry, raw) -> str:
    """The sample digest (`checkpoint.format.samples`) of tensor ENTRY in the chain's step, from its bytes RAW in
    the chain's full step (a numpy uint8 array), rebuilt in the sample's windows alone.

    Each window's elements are copied from RAW and patched by every link in turn (`Delta.apply_span`, decoding
    only the chunks over them): the digest `buffer_sample` gives of the tensor rebuilt whole (`rebuilt_bytes`),
    for a few windows' work instead of the tensor's. Unlike `rebuilt_bytes`, the rest of the tensor is not proved
    against the step's digest: a reload that rebuilds it proves it then.

    Raises:
        LayerwiseError: a link's chunk over a window is corrupt, or its positions are invalid.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = DTYPE_SIZES[entry.dtype]
    patching = [link for link in chain.links if entry.name in link.patches]
    windows = {}
    for offset, length in sample_spans(entry.nbytes):
        first, stop = offset // size, -(-(offset + length) // size)  # the elements the window touches
        span = np.array(raw[first * size:stop * size]).view(unsigned_type(size))
        for link in patching:
            link.apply_span(entry.name, span, first)
        skip = offset - first * size
        windows[offset] = span.view(np.uint8)[skip:skip + length]
    return sample_digest(entry.dtype, entry.shape, entry.nbytes, lambda offset, _: windows[offset])


# Bytes copied, patched and hashed at a time by `_rebuilt_in_one_pass`: in cache for all three.
_PASS_BLOCK = 1 << 20


def _rebuilt_in_one_pass(link: Delta, entry: TensorEntry, raw, buffers: RebuildBuffers | None):
    """LINK's v2 patch of ENTRY applied to RAW, and the result's digest, in one pass over memory: block by block,
    each copied from RAW, its changes added, and hashed while it is in cache (instead of a copy, a patch and a
    hash, each a pass of its own). Returns (the bytes, their digest)."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = DTYPE_SIZES[entry.dtype]
    if raw.size != entry.numel * size:
        link.apply(entry.name, raw)  # refuses it, naming the sizes
    out = np.empty(raw.size, dtype=np.uint8) if buffers is None else buffers.take(raw.size)
    elements = out.view(unsigned_type(size))
    hasher = TensorHasher(entry.dtype, entry.shape)
    per_block = _PASS_BLOCK // size
    done = 0  # elements copied and hashed
    for chunk, positions, diffs in link.changes(entry.name):
        cuts = np.searchsorted(positions, np.arange(chunk.start, chunk.end + per_block, per_block))
        for index, start in enumerate(range(chunk.start, chunk.end, per_block)):
            _copied_and_hashed(out, raw, hasher, done * size, start * size)  # unchanged elements before it
            end = min(start + per_block, chunk.end)
            np.copyto(out[start * size:end * size], raw[start * size:end * size])
            lo, hi = cuts[index], cuts[index + 1]
            elements[positions[lo:hi]] += diffs[lo:hi]  # modulo 2**bits: numpy's unsigned arithmetic wraps
            hasher.update(out[start * size:end * size])
            done = end
    _copied_and_hashed(out, raw, hasher, done * size, raw.size)
    return out, hasher.hexdigest()


def _copied_and_hashed(out, raw, hasher: TensorHasher, begin: int, end: int) -> None:
    """Bytes [BEGIN, END) of RAW copied into OUT and hashed, block by block."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    for at in range(begin, end, _PASS_BLOCK):
        stop = min(at + _PASS_BLOCK, end)
        np.copyto(out[at:stop], raw[at:stop])
        hasher.update(out[at:stop])


def _why_not_the_step(chain: DeltaChain, entry: TensorEntry, raw, where: str) -> LayerwiseError:
    """The error for a tensor whose rebuilt bytes are not the step's: RAW is not the base, or which link is corrupt."""
    first = chain.links[0]
    if tensor_digest(entry.dtype, entry.shape, raw) != first.base_digests[entry.name]:
        return LayerwiseError(f"tensor {entry.name}: its bytes are not the delta's base {first.base_location} "
                              "(the base changed since the delta was written)", where=where)
    for link in chain.links:
        if entry.name not in link.patches:
            continue
        raw = link.apply(entry.name, raw)
        if tensor_digest(entry.dtype, entry.shape, raw) != link.step_digests[entry.name]:
            break
    return LayerwiseError(f"tensor {entry.name}: the rebuilt bytes do not hash to the step's digest (corrupt delta)",
                          where=str(link.path))


def rebuilt_tensor(chain: DeltaChain, entry: TensorEntry, base, where: str, buffers: RebuildBuffers | None = None):
    """Tensor ENTRY of the step, from its BASE tensor (as read from the full step's file): `rebuilt_bytes`.

    Args:
        chain: the deltas, oldest first (`Checkpoint.delta`).
        entry: the tensor as the full step's header describes it.
        base: its tensor there (a contiguous host torch tensor).
        where: the full step's shard file, for the message.
        buffers: buffers for the result (`rebuilt_bytes`), or None for new ones.

    Returns:
        The step's tensor (BASE itself when no link changes it).
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    raw = base.reshape(-1).view(torch.uint8).numpy()
    out = rebuilt_bytes(chain, entry, raw, where, buffers)
    if out is raw:
        return base
    return torch.from_numpy(out).view(base.dtype).reshape(base.shape)
