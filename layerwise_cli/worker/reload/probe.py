"""Measure, during a reload, what vLLM's layerwise bookkeeping buffers."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from layerwise_cli import vllm_compat


def _buffered_tensor_bytes(bound_args) -> int:
    """Bytes of the checkpoint tensor(s) held by one buffered weight-loader call."""
    total = 0
    for name, value in bound_args.arguments.items():
        # `param` is the (meta) destination, not a buffered copy.
        if name != "param" and isinstance(value, torch.Tensor) and value.device.type != "meta":
            total += value.numel() * value.element_size()
    return total


@dataclass
class _OpenModule:
    info: object
    weights: list  # the info's `loaded_weights` list object we have summed
    counted: int = 0  # entries of `weights` already summed
    bytes: int = 0


@dataclass
class _LayerTiming:
    first: float
    last_handover: float = 0.0
    tensors: int = 0
    bytes: int = 0
    done: float | None = None
    buffered_at_completion: int = 0


class BufferProbe:
    """Reads vLLM's per-module `loaded_weights` buffers between tensor handovers.

    Before each tensor is handed to `model.load_weights`, it sums the bytes of
    the tensors that vLLM's layer buffers (`LAYERWISE_INFO[module].loaded_weights`)
    hold, and adds the tensor about to be handed over: exactly the buffered
    bytes that `inspect-order` predicts. Only the expected parent module and
    modules already open are read per tensor (incrementally), so the cost per
    tensor does not grow with the number of tensors in a layer; at every
    change of parent layer all modules are scanned once to catch buffers the
    plan did not expect.
    """

    def __init__(self, model: torch.nn.Module, on_layer_done=None) -> None:
        self._infos = vllm_compat.layerwise_info()
        self._modules = dict(model.named_modules())
        self._open: dict[str, _OpenModule] = {}
        self.peak = 0
        self.peak_tensor = ""
        self.timings: dict[str, _LayerTiming] = {}
        self.unexpected: list[str] = []
        self._pending: tuple[str, str | None, int] | None = None
        self._last_parent: str | None = None
        self._on_layer_done = on_layer_done or (lambda name, timing: None)
        # (name, info) of every module vLLM keeps reload info for; rebuilt when that set changes.
        # vLLM resets an info in place, so the objects stay valid for the whole reload.
        self._scan_list: list[tuple[str, object]] = []
        self._scan_key = -1

    def before_handover(self, tensor_name: str, parent: str | None, nbytes: int) -> None:
        """Account for the previous handover and record the buffer as this tensor arrives."""
        self._settle()
        if parent != self._last_parent:
            self._full_scan()
            self._last_parent = parent
        buffered = sum(self._refresh(name) for name in list(self._open)) + (nbytes if parent else 0)
        if buffered > self.peak:
            self.peak, self.peak_tensor = buffered, tensor_name
        now = time.perf_counter()
        if parent is not None:
            timing = self.timings.get(parent)
            if timing is None:
                timing = self.timings[parent] = _LayerTiming(first=now)
            timing.tensors += 1
            timing.bytes += nbytes
            timing.last_handover = now
            timing.buffered_at_completion = buffered
        self._pending = (tensor_name, parent, nbytes)

    def finish(self) -> None:
        """Account for the last handover (call when the stream is exhausted)."""
        self._settle()

    def _settle(self) -> None:
        """After vLLM took the pending tensor: did its layer buffer it, or complete?"""
        if self._pending is None:
            return
        tensor_name, parent, _ = self._pending
        self._pending = None
        if parent is None:
            return
        module = self._modules.get(parent)
        info = self._infos.get(module) if module is not None else None
        if info is None:
            self.unexpected.append(tensor_name)
            return
        if info.loaded_weights:
            if parent not in self._open:
                self._open[parent] = _OpenModule(info, info.loaded_weights)
            self._refresh(parent)
        else:
            # The layer's buffer is empty again: vLLM processed it in this handover.
            self._open.pop(parent, None)
            timing = self.timings[parent]
            timing.done = time.perf_counter()
            self._on_layer_done(parent, timing)

    def _refresh(self, name: str) -> int:
        entry = self._open[name]
        weights = entry.info.loaded_weights
        if weights is not entry.weights or len(weights) < entry.counted:
            # vLLM reset this module's info (processed): nothing buffered now.
            if not weights:
                del self._open[name]
                timing = self.timings.get(name)
                if timing is not None and timing.done is None:
                    timing.done = time.perf_counter()
                    self._on_layer_done(name, timing)
                return 0
            entry.weights, entry.counted, entry.bytes = weights, 0, 0
        for _, bound_args in weights[entry.counted:]:
            entry.bytes += _buffered_tensor_bytes(bound_args)
        entry.counted = len(weights)
        return entry.bytes

    def _full_scan(self) -> None:
        if len(self._infos) != self._scan_key:
            self._scan_key = len(self._infos)
            self._scan_list = [(name, info) for name, module in self._modules.items()
                               if (info := self._infos.get(module)) is not None]
        for name, info in self._scan_list:
            if info.loaded_weights and name not in self._open:
                self._open[name] = _OpenModule(info, info.loaded_weights)


def process_disk_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage so far (Linux `/proc/self/io`), or None.

    Page-cache hits are not counted: a file already cached costs no disk read.
    """
    try:
        with open("/proc/self/io") as handle:
            for line in handle:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
