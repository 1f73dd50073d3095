"""A cheap fingerprint of the state a parent layer computes with, to tell whether anything changed it.

Taken right after layerwise's own reload of a layer and taken again before the
layer is skipped on the next reload: if anything else wrote the layer in
between (vLLM's own `reload_weights`, `/update_weights`, a rollback), the two
differ and the layer is reloaded. It is not a digest of the checkpoint (that is
`checkpoint.digests`); it is a checksum of the engine's tensors as they are.

What it covers, per module of the layer (the layer's own module and its
submodules, and modules that share storage with it, such as a tied head):

- every parameter and buffer that keeps storage: name, dtype, shape, storage
  pointer and a checksum of its raw bytes. On the CPU the checksum is
  xxh3-64 of the bytes, read in place (no copy); on any other device it is a
  position-weighted integer sum over the raw 32-bit words computed with torch
  on the tensor's device (`device_checksum`), so the check stays memory-bound
  there and only a few integers cross to the host per layer;
- the identity of the CPU kernel handle (`cpu_linear`): vLLM's CPU backend
  repacks a linear layer's weight into an opaque oneDNN or SGL handle and
  empties `weight`; any reload that processes the layer makes a new handle, so
  a held weak reference that no longer names the current handle is a change.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from layerwise_cli.worker.stream.cpu_placement import move_to

# Attributes holding kernel state built from a layer's weights that no tensor shows (vLLM's CPU GEMM dispatch).
KERNEL_ATTRIBUTES = ("cpu_linear",)
# 32-bit words summed per chunk on a device: bounds the int64 temporary (32 MiB).
_CHUNK_WORDS = 1 << 22
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class _Handle:
    """An object compared by identity, held weakly where it can be (a dead reference never equals a live one)."""

    __slots__ = ("_ref", "_strong")

    def __init__(self, obj) -> None:
        try:
            self._ref, self._strong = weakref.ref(obj), None
        except TypeError:  # builtins: they hold no weights
            self._ref, self._strong = None, obj

    def target(self):
        return self._ref() if self._ref is not None else self._strong

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Handle):
            return NotImplemented
        mine = self.target()
        return mine is not None and mine is other.target()

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"_Handle({type(self.target()).__name__})"


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _word_weights(device: torch.device, length: int) -> torch.Tensor:
    """Fixed pseudo-random odd int64 multipliers, one per word position in a chunk (cached per device)."""
    key = (str(device), length)
    weights = _WEIGHTS.get(key)
    if weights is None:
        index = torch.arange(1, length + 1, dtype=torch.int64, device=device)
        weights = index * _signed64(_GOLDEN)  # wraps modulo 2**64
        weights = weights ^ (weights >> 29)
        weights = weights * _signed64(0xBF58476D1CE4E5B9)
        weights = (weights ^ (weights >> 32)) | 1
        _WEIGHTS[key] = weights
    return weights


def _chunk_weight(index: int) -> int:
    """splitmix64 of the chunk index, odd: chunks at other positions count differently."""
    z = (index + 1) * _GOLDEN & _MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return (z ^ (z >> 31)) | 1


def device_sums(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Per chunk of 32-bit words, sum(word * weight[position]) modulo 2**64, as int64 tensors on the tensor's device.

    Exact integer arithmetic (wrapping modulo 2**64), so the result does not
    depend on the order of the reduction. Multipliers are odd, so any change of
    one word changes the sum; they differ per position, so moved words do too.
    """
    raw = tensor.detach().reshape(-1)
    if not raw.is_contiguous():
        raw = raw.contiguous()
    raw = raw.view(torch.uint8)
    nbytes = raw.numel()
    words_n = nbytes // 4
    if words_n and raw.storage_offset() % 4:
        raw = raw.clone()
    sums = []
    if words_n:
        words = raw[:words_n * 4].view(torch.int32)
        for start in range(0, words_n, _CHUNK_WORDS):
            chunk = words[start:start + _CHUNK_WORDS].to(torch.int64)
            chunk.mul_(_word_weights(tensor.device, _CHUNK_WORDS)[:chunk.numel()])
            sums.append(chunk.sum())
    if nbytes % 4:
        tail = raw[words_n * 4:].to(torch.int64)
        tail.mul_(_word_weights(tensor.device, 4)[:tail.numel()])
        sums.append(tail.sum())
    return sums


def combine_sums(values: Iterable[int]) -> int:
    """One 64-bit checksum from the chunk sums `device_sums` gave (read back to the host)."""
    total = 0
    for index, value in enumerate(values):
        total = (total + (int(value) & _MASK64) * _chunk_weight(index)) & _MASK64
    return total


def device_checksum(tensor: torch.Tensor) -> int:
    """The position-weighted word checksum of one tensor (see `device_sums`), computed where the tensor lives."""
    sums = device_sums(tensor)
    return combine_sums(torch.stack(sums).cpu().tolist() if sums else [])


def host_checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a CPU tensor's raw bytes, read in place."""
    data = tensor.detach().reshape(-1)
    if not data.is_contiguous():
        data = data.contiguous()
    if data.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(data.view(torch.uint8).numpy().data)


def _own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    items = list(module._parameters.items()) + list(module._buffers.items())
    return [(name, t) for name, t in items if t is not None and t.device.type != "meta" and t.numel() > 0]


def _is_on_meta(module: torch.nn.Module) -> bool:
    return any(t is not None and t.device.type == "meta"
               for t in list(module._parameters.values()) + list(module._buffers.values()))


class _Pending:
    """A device checksum still on the device: read back with the others of the same pass."""

    __slots__ = ("sums", "value")

    def __init__(self, sums: list[torch.Tensor]) -> None:
        self.sums = sums
        self.value: int | None = None


def layer_fingerprints(modules: dict[str, torch.nn.Module], layers: dict[str, list[str]],
                       known: Mapping[tuple[int, int], int] | None = None) -> dict[str, tuple]:
    """The fingerprint of each layer: see the module docstring.

    Args:
        modules: the model's `named_modules()` as a dict.
        layers: layer name -> the names of the modules it covers (the layer's
            module first, then modules deriving from it, such as a tied head).
        known: (data pointer, bytes) -> the `host_checksum` of a host tensor whose bytes the caller just hashed
            (a delta's patch proves what it wrote in the same pass): not read again.

    Returns:
        Layer name -> a tuple compared with `==`; a layer whose module is on
        the meta device (a reload in progress) or missing gets a fresh object
        that equals nothing.
    """
    pending: list[_Pending] = []
    shaped = {layer: _layer_parts(modules, names, pending, known or {}) for layer, names in layers.items()}
    _read_back(pending)
    return {layer: tuple(tuple(p.value if isinstance(p, _Pending) else p for p in part)
                         if isinstance(part, tuple) else part for part in parts)
            for layer, parts in shaped.items()}


def _layer_parts(modules: dict[str, torch.nn.Module], names: list[str], pending: list[_Pending],
                 known: Mapping[tuple[int, int], int]) -> list:
    parts: list = []
    for module_name in names:
        root = modules.get(module_name)
        if root is None:
            return [object()]
        for sub_name, module in root.named_modules(prefix=module_name):
            if _is_on_meta(module):
                return [object()]
            for name, tensor in _own_tensors(module):
                if tensor.device.type == "cpu":
                    check: object = known.get((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
                    if check is None:
                        check = host_checksum(tensor)
                else:
                    check = _Pending(device_sums(tensor))
                    pending.append(check)
                parts.append((f"{sub_name}.{name}", str(tensor.dtype), tuple(tensor.shape),
                              tensor.untyped_storage().data_ptr(), check))
            for attribute in KERNEL_ATTRIBUTES:
                handle = getattr(module, attribute, None)
                if handle is not None:
                    parts.append((f"{sub_name}#{attribute}", _Handle(handle)))
    return parts


def _read_back(pending: list[_Pending]) -> None:
    """One device-to-host transfer per device for every pending checksum of a pass."""
    by_device: dict[str, list[_Pending]] = {}
    for item in pending:
        if item.sums:
            by_device.setdefault(str(item.sums[0].device), []).append(item)
        else:
            item.value = combine_sums([])
    for items in by_device.values():
        values = torch.stack([s for item in items for s in item.sums]).cpu().tolist()
        offset = 0
        for item in items:
            item.value = combine_sums(values[offset:offset + len(item.sums)])
            offset += len(item.sums)


def stored_bytes(modules: dict[str, torch.nn.Module], names: list[str],
                 known: Mapping[tuple[int, int], int] | None = None) -> int:
    """Bytes of the stored tensors a fingerprint of these modules (and their submodules) reads (those whose
    checksum is KNOWN are not read)."""
    total = 0
    for module_name in names:
        root = modules.get(module_name)
        if root is None:
            continue
        for module in root.modules():
            sizes = ((t.data_ptr(), t.numel() * t.element_size()) for _, t in _own_tensors(module))
            total += sum(size for pointer, size in sizes if (pointer, size) not in (known or {}))
    return total


def layer_fingerprints_parallel(modules: dict[str, torch.nn.Module], layers: dict[str, list[str]],
                                spare: set[int], min_bytes: int = 32 << 20,
                                known: Mapping[tuple[int, int], int] | None = None) -> dict[str, tuple]:
    """`layer_fingerprints` of host tensors in two threads, the second bound to SPARE (the CPUs beside the engine).

    The layers are split in two parts of about equal bytes; with no spare CPU,
    or fewer than MIN_BYTES to read, everything runs in the calling thread.
    The result equals `layer_fingerprints(modules, layers, known)`.
    """
    sizes = {layer: stored_bytes(modules, names, known) for layer, names in layers.items()}
    if not spare or len(layers) < 2 or sum(sizes.values()) < min_bytes:
        return layer_fingerprints(modules, layers, known)
    mine: dict[str, list[str]] = {}
    other: dict[str, list[str]] = {}
    weights = [0, 0]
    for layer in sorted(layers, key=lambda name: -sizes[name]):
        side = 0 if weights[0] <= weights[1] else 1
        (mine if side == 0 else other)[layer] = layers[layer]
        weights[side] += sizes[layer]

    def beside() -> dict[str, tuple]:
        move_to(spare)
        return layer_fingerprints(modules, other, known)

    with ThreadPoolExecutor(1, thread_name_prefix="layerwise-fingerprint") as pool:
        future = pool.submit(beside)
        found = layer_fingerprints(modules, mine, known)
        found.update(future.result())
    return {layer: found[layer] for layer in layers}

