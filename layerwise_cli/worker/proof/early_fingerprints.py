"""The records' fingerprints of finished layers, taken by the reading thread while the engine works on later ones.

A reload records, for every layer it handed over, the fingerprint of the
layer's state right after the reload (`worker.layer_state`). Taken at the
end, those fingerprints read every stored engine tensor once more while the
caller waits. But a layer vLLM has processed is final as soon as it is done:
nothing in the rest of the reload writes it, except what is known to (vLLM's
finalize processes only layers that were not done; layerwise's own repairs
name each module they refresh). So on the CPU, each finished layer is
fingerprinted by the reading thread, on its own core where it has one, while
the engine loads the following layers; at the end only the layers this cannot
vouch for are fingerprinted:

- a layer that covers other modules (a tied head that shares its weight):
  those are written by the repairs after the stream;
- a layer a repair refreshed, or one within or around a refreshed module;
- a layer handed another tensor after it was done (never in layer order), or
  one around a layer handed a tensor after it was done: a layer's fingerprint
  covers its submodules, and a submodule may be a layer of its own, finished
  later (a Mamba mixer's own tensors come before its `conv1d` and projections);
- a layer finished after the reading thread stopped (the last ones).

Only on the CPU: on a GPU the checksums run on the device, where the reading
thread's stream would not be ordered after the engine's processing, and
they cost little there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import torch

from layerwise_cli.worker.state.layer_state import layer_fingerprints


class EarlyFingerprints:
    """Fingerprints of done layers, computed in `step` (the reading thread), used by `LayerSkip.record`.

    Args:
        modules: the model's `named_modules()` as a dict.
        covers: layer -> the modules its fingerprint covers (its own first).
    """

    def __init__(self, modules: dict[str, torch.nn.Module], covers: Mapping[str, list[str]]) -> None:
        self._modules = modules
        self._covers = covers
        self._todo: deque[str] = deque()
        self._done: set[str] = set()
        self._reopened: set[str] = set()
        self._taken: dict[str, object] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0
        # Called when a layer is queued (the stream's `OpenStream.wake`, once the stream is open).
        self.wake: Callable[[], None] = lambda: None

    def layer_done(self, name: str) -> None:
        """The engine thread: vLLM finished NAME (the probe saw its buffer emptied).

        A layer around NAME done before it covers what was just processed: its fingerprint is worthless.
        """
        self._reopen(_enclosing(name)[1:])
        if self._covers.get(name) == [name]:
            self._done.add(name)
            self._todo.append(name)
            self.wake()

    def handing_over(self, parent: str | None) -> None:
        """The engine thread, before each tensor: a tensor for a done layer, or for a layer inside one, makes the
        done layer's fingerprint worthless (it covers its submodules)."""
        if parent is not None:
            self._reopen(_enclosing(parent))

    def _reopen(self, names: Iterable[str]) -> None:
        """Drop the fingerprints of the done layers among NAMES, and of any taken of them later."""
        stale = [name for name in names if name in self._done]
        if stale:
            with self._lock:
                self._reopened.update(stale)
                for name in stale:
                    self._taken.pop(name, None)

    def step(self) -> bool:
        """The reading thread: fingerprint the next done layer; False when none is waiting."""
        try:
            name = self._todo.popleft()
        except IndexError:
            return False
        start = time.perf_counter()
        fingerprint = layer_fingerprints(self._modules, {name: [name]})[name]
        with self._lock:
            if name not in self._reopened:
                self._taken[name] = fingerprint
        self.seconds += time.perf_counter() - start
        return True

    def valid(self, refreshed: Iterable[str]) -> dict[str, object]:
        """Once the reading thread has stopped: the fingerprints still true, given the modules refreshed since."""
        touched = list(refreshed)
        with self._lock:
            return {name: fingerprint for name, fingerprint in self._taken.items()
                    if not any(_related(name, module) for module in touched)}


def _enclosing(name: str) -> list[str]:
    """NAME and every module name around it (`a.b.c`: `a.b.c`, `a.b`, `a`)."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts), 0, -1)]


def _related(layer: str, module: str) -> bool:
    """Whether MODULE is LAYER, inside it or around it."""
    return module == layer or module.startswith(layer + ".") or layer.startswith(module + ".")
