"""Which checkpoint tensors vLLM's weight loaders only copy, byte for byte, into the engine's tensors.

vLLM's layerwise reload counts what each weight-loader call will load by
running it once as the tensor is handed over, on the layer's meta tensors,
under its `CopyCounter` (`get_numel_loaded`). layerwise watches that same
call and records, for the tensor being handed over, every copy it makes: into
which of the layer's tensors, at which offset, from which part of the
checkpoint tensor. A tensor whose loader call only takes views and copies
contiguous runs of the same dtype (no transpose, no cast, no arithmetic) is a
*plain copy*: the next reload may read its bytes from the file straight into
the engine's tensor (`read_into_place`).

When vLLM then replays the call on the materialized layer (`_layerwise_process`)
the loader copies the handed-over tensor into the engine tensor again: that copy
is skipped when, and only when, it copies exactly the bytes already read there
to exactly that place (`LoaderWatch.filled`). Everything else runs as vLLM
runs it: the same calls, the same counts, the same processing. A layer vLLM
materializes in fresh tensors gets the copy as usual, from the handed-over
tensor (the checkpoint's own bytes), and its processed result copied over
the engine's tensor, as without layerwise.

A region read into place whose copy never came in a layer loaded into the
engine's own tensors is a reload that cannot be shown complete
(`unconfirmed`): the caller fails it, and the engine is rolled back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise_cli.errors import LayerwiseError

# The aten ops a plain-copy loader may run besides `copy_`: views and the metadata they need.
_VIEW_OPS = {"detach", "alias", "slice", "narrow", "select", "view", "_reshape_alias", "reshape", "unsqueeze",
             "squeeze", "split", "split_with_sizes", "chunk", "unbind", "flatten", "unflatten", "expand",
             "as_strided", "t", "transpose", "permute", "sym_size", "sym_stride", "sym_numel", "lift_fresh",
             "_unsafe_view"}

# Constants a loader may write into its parameter beside the bytes it copies (a vocabulary's padding rows).
_FILL_OPS = {"fill_", "zero_"}


@dataclass(frozen=True)
class PlainCopy:
    """One contiguous run a loader copies from a checkpoint tensor into an engine tensor, same dtype.

    Offsets and `numel` count elements from the start of each tensor.
    """

    module: str
    tensor: str
    dst_offset: int
    src_offset: int
    numel: int


@dataclass(frozen=True)
class TensorCopies:
    """What vLLM's loader did with one checkpoint tensor of this dtype and shape, last reload."""

    dtype: str  # the safetensors dtype name
    shape: tuple[int, ...]
    copies: tuple[PlainCopy, ...]


@dataclass
class LoaderFacts:
    """What a worker learned of its engine's loaders (kept between reloads; `kept_on`).

    `copies`: checkpoint tensor name -> its plain copies. `not_plain`: tensor
    name -> (dtype, shape) of those whose loader did more. Both hold for the
    engine's life (its loaders do not change), so a tensor known either way is
    not watched again. `in_place`: the modules loaded into the engine's own
    tensors (`in_place`) by the last reload that handed them over: only their
    tensors are read into place.
    """

    copies: dict[str, TensorCopies] = field(default_factory=dict)
    not_plain: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    in_place: set[str] = field(default_factory=set)

    def knows(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        """Whether the loader of tensor NAME of this DTYPE and SHAPE was seen already (a plain copy or not)."""
        fact = self.copies.get(name)
        if fact is not None:
            return fact.dtype == dtype and fact.shape == shape
        return self.not_plain.get(name) == (dtype, shape)

    def learned(self, seen: dict[str, TensorCopies | tuple], in_place: set[str], handed: set[str]) -> None:
        """After a completed reload: what its loader calls showed, and the modules it loaded in place.

        HANDED: the layers it handed to vLLM; a layer it skipped keeps what the reload before showed.
        """
        for name, found in seen.items():
            if isinstance(found, TensorCopies):
                self.copies[name] = found
                self.not_plain.pop(name, None)
            else:
                self.copies.pop(name, None)
                if found is not None:
                    self.not_plain[name] = found
        self.in_place = (self.in_place - handed) | set(in_place)

    def forget(self) -> None:
        """After a failed reload: nothing is read into place until a reload completes again."""
        self.in_place = set()

    def after_reload(self, watch: LoaderWatch, *, failed: bool, in_place, handed: set[str], watched: bool) -> None:
        """What one reload leaves: `forget` if it FAILED, else `learned` from WATCH (IN_PLACE: its `InPlaceLayers`).

        A reload not WATCHED (reading into place off) learns no copy, and a layer it handed over that did not
        load in place is dropped from `in_place`.
        """
        names = in_place.names if in_place is not None else set()
        if failed:
            self.forget()
        elif watched:
            self.learned(watch.seen, names, handed)
        else:
            self.in_place -= handed - set(names)


@dataclass
class Filled:
    """A region the reader filled from the file: the engine tensor's bytes and the handed-over tensor's."""

    module: str
    dst_ptr: int
    src_ptr: int
    numel: int
    dtype: torch.dtype
    confirmed: bool = False


class LoaderWatch:
    """During one reload: learns the loaders' plain copies, and skips the copies of regions already read in place.

    Open it around vLLM's `reload_weights` (`watching`); call `handing` just
    before each tensor is handed to vLLM; the reader calls `fill` after it read
    a region into an engine tensor.
    """

    def __init__(self, model: torch.nn.Module, facts: LoaderFacts | None = None) -> None:
        self._model = model
        self._facts = facts or LoaderFacts()
        self._layer_ids: set[int] = set()  # the modules holding regions read into place (`fill`)
        self._names: dict[int, tuple[str, str]] = {}
        self._current: tuple[str, str, int, int, torch.dtype, tuple[int, ...]] | None = None
        # Checkpoint tensor -> its copies, or (dtype, shape) when not a plain copy: from the loader calls made
        # while it was handed.
        self.seen: dict[str, TensorCopies | tuple] = {}
        self.filled: dict[int, Filled] = {}
        self._fills: dict[str, list[tuple[int, int]]] = {}  # checkpoint tensor -> the spans its loader filled
        self._lock = threading.Lock()

    def handing(self, name: str, dtype: str, tensor: torch.Tensor) -> None:
        """TENSOR (checkpoint name NAME, safetensors DTYPE) is handed to vLLM next: the loader calls until the next
        one are its."""
        if self._facts.knows(name, dtype, tuple(tensor.shape)):
            self._current = None  # seen in an earlier reload: its copies are checked at the replay (`filled`)
            return
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            self._current = None
            self.seen[name] = (dtype, tuple(tensor.shape))
            return
        self._current = (name, dtype, tensor.data_ptr(), tensor.numel(), tensor.dtype, tuple(tensor.shape))

    def fill(self, region: Filled, layer: torch.nn.Module) -> None:
        """The reader filled REGION of LAYER's tensor: a replayed copy of exactly it is skipped."""
        with self._lock:
            self.filled[region.dst_ptr] = region
            self._layer_ids.add(id(layer))

    def check_confirmed(self, in_place_modules: set[str]) -> None:
        """Raise `LayerwiseError` unless every region read into place in IN_PLACE_MODULES met its copy."""
        missed = self.unconfirmed(in_place_modules)
        if missed:
            shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
            raise LayerwiseError(f"read into place: vLLM's loader did not copy what was read into {shown} as the "
                                 "last reload showed; the reload cannot be shown complete "
                                 "(without LAYERWISE_READ_INTO_PLACE the copy is left to vLLM)")

    def unconfirmed(self, in_place_modules: set[str]) -> list[str]:
        """Modules loaded in the engine's own tensors where a region read into place met no matching copy."""
        return sorted({f.module for f in self.filled.values() if not f.confirmed and f.module in in_place_modules})

    @contextlib.contextmanager
    def watching(self, active: bool = True) -> Iterator[LoaderWatch]:
        """Patch vLLM's count and its per-layer processing for the duration of one reload (unless not ACTIVE)."""
        from layerwise_cli import vllm_compat

        if not active:
            yield self
            return

        module = vllm_compat.reload_loader_hooks()
        count, process = module.get_numel_loaded, module._layerwise_process
        watch = self

        def get_numel_loaded(weight_loader, args):
            if watch._current is None:
                return count(weight_loader, args)
            with _CountWatch(watch, args.arguments.get("param")):
                return count(weight_loader, args)

        def layerwise_process(layer, info):
            if id(layer) not in watch._layer_ids:
                return process(layer, info)  # nothing of it read into place: vLLM's as it is
            with _ReplaySkip(watch):
                return process(layer, info)

        module.get_numel_loaded, module._layerwise_process = get_numel_loaded, layerwise_process
        try:
            yield self
        finally:
            module.get_numel_loaded, module._layerwise_process = count, process

    def _name_of(self, param) -> tuple[str, str] | None:
        found = self._names.get(id(param))
        if found is None:
            # Built after vLLM moved the layers to meta (their tensors are new objects then); again on a miss.
            self._names = {id(t): (module_name, tensor_name) for module_name, module in self._model.named_modules()
                           for tensor_name, t in (*module._parameters.items(), *module._buffers.items())
                           if t is not None}
            found = self._names.get(id(param))
        return found

    def _saw(self, param, func, args) -> None:
        """One aten op of a counted loader call: a plain copy of the current tensor, or the end of its claim."""
        current = self._current
        if current is None:
            return
        name, dtype_name, base, numel, dtype, shape = current
        if isinstance(self.seen.get(name), tuple):
            return  # already shown not to be a plain copy
        op = func.__name__.split(".")[0]
        if op in _VIEW_OPS:
            return
        known = self.seen.get(name)
        copies = known.copies if isinstance(known, TensorCopies) else ()
        copy = None
        if func is torch.ops.aten.copy_.default:
            copy = self._plain_copy(param, args[0], args[1], base, numel, dtype)
            fills = self._fills.get(name, [])
            if copy is not None and any(_overlap(span, _copy_span(copy)) for span in fills):
                copy = None  # a constant written first, then bytes over it: the replay's order would matter
        elif op in _FILL_OPS and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            span = _span(args[0], param)
            if span is None:
                return  # an empty fill (padding rows a vocabulary does not have)
            if span[0] >= 0 and not any(_overlap(span, _copy_span(done)) for done in copies):
                # A constant written beside the copied bytes (a vocabulary's padding rows): the replay writes it too.
                self._fills.setdefault(name, []).append(span)
                return
        if copy is None:
            self.seen[name] = (dtype_name, shape)
            return
        self.seen[name] = TensorCopies(dtype_name, shape, (*copies, copy))

    def _plain_copy(self, param, dst, src, base: int, numel: int, dtype: torch.dtype) -> PlainCopy | None:
        if not isinstance(param, torch.Tensor) or not param.is_meta or not param.is_contiguous():
            return None
        if not dst.is_meta or dst.untyped_storage()._cdata != param.untyped_storage()._cdata:
            return None
        if src.device.type != "cpu" or not (dst.dtype == src.dtype == param.dtype == dtype):
            return None
        if not dst.is_contiguous() or not src.is_contiguous() or dst.numel() != src.numel():
            return None
        size = src.element_size()
        start = src.data_ptr() - base
        if start < 0 or start % size or start // size + src.numel() > numel:
            return None
        where = self._name_of(param)
        if where is None:
            return None
        return PlainCopy(module=where[0], tensor=where[1], dst_offset=dst.storage_offset() - param.storage_offset(),
                         src_offset=start // size, numel=src.numel())


def _span(tensor: torch.Tensor, param) -> tuple[int, int] | None:
    """The elements of PARAM's storage a view could touch, from its start: [first, end); None when it is empty."""
    if tensor.numel() == 0:
        return None
    if not isinstance(param, torch.Tensor) or tensor.untyped_storage()._cdata != param.untyped_storage()._cdata:
        return (-1, -1)
    first = tensor.storage_offset() - param.storage_offset()
    return first, first + 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))


def _copy_span(copy: PlainCopy) -> tuple[int, int]:
    return copy.dst_offset, copy.dst_offset + copy.numel


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class _CountWatch(TorchDispatchMode):
    """Sees the aten ops of one loader call vLLM counts (on meta tensors: nothing is copied)."""

    def __init__(self, watch: LoaderWatch, param) -> None:
        super().__init__()
        self._watch = watch
        self._param = param

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._watch._saw(self._param, func, args)
        return func(*args, **(kwargs or {}))


class _ReplaySkip(TorchDispatchMode):
    """While vLLM processes a layer: a copy of a region the reader already filled, onto itself, is not made."""

    def __init__(self, watch: LoaderWatch) -> None:
        super().__init__()
        self._filled = watch.filled

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and self._filled:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == "cpu":
                region = self._filled.get(dst.data_ptr())
                if (region is not None and region.src_ptr == src.data_ptr() and region.numel == dst.numel()
                        == src.numel() and dst.dtype == src.dtype == region.dtype and dst.is_contiguous()
                        and src.is_contiguous()):
                    region.confirmed = True
                    return dst
        return func(*args, **(kwargs or {}))
