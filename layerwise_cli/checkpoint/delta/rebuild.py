"""A delta step's tensors rebuilt from their bytes in the chain's full step through every link's patch, proved.

What reading a delta step comes down to (`source.open_step` opens it as the full step it rebuilds): each tensor's
bytes in the full step at the chain's start, every link's patch applied in turn, and the result proved by the
step's digest of it (`rebuilt_bytes`, `rebuilt_tensor`); or only a sample's windows rebuilt, for the spot check
of the step an engine holds (`rebuilt_sample`).
"""

from __future__ import annotations

from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.format import Delta, unsigned_type
from layerwise_cli.checkpoint.delta.source import DeltaChain
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.digests import TensorHasher, tensor_digest
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, TensorEntry
from layerwise_cli.checkpoint.format.samples import sample_digest, sample_spans
from layerwise_cli.errors import LayerwiseError


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

    Each window's elements are copied from RAW and patched by every link in turn (`Delta.apply_spans`, decoding
    only the chunks under them, each once): the digest `buffer_sample` gives of the tensor rebuilt whole
    (`rebuilt_bytes`), for a few windows' work instead of the tensor's. Unlike `rebuilt_bytes`, the rest of the
    tensor is not proved against the step's digest: a reload that rebuilds it proves it then.

    Raises:
        LayerwiseError: a link's chunk over a window is corrupt, or its positions are invalid.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = DTYPE_SIZES[entry.dtype]
    spans, windows = [], {}
    for offset, length in sample_spans(entry.nbytes):
        first, stop = offset // size, -(-(offset + length) // size)  # the elements the window touches
        span = np.array(raw[first * size:stop * size]).view(unsigned_type(size))
        spans.append((span, first))
        skip = offset - first * size
        windows[offset] = span.view(np.uint8)[skip:skip + length]
    for link in chain.links:
        link.apply_spans(entry.name, spans)
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
