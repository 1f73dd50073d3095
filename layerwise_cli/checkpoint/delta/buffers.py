"""Host buffers for the tensors a delta rebuilds, reused once nothing refers to them any more.

A rebuilt tensor needs memory of its own: the base's bytes are a read-only
mapping of its file, and the patch is written over a copy. Fresh memory is paid
for at its first touch, page by page (a fault and a zeroed page each: on a
virtual machine also the host's fault), which costs more than the copy and the
patch together. The tensors of one layer have the same sizes as the next
layer's, and vLLM lets go of a layer's tensors once it has loaded the layer: so
a buffer is taken again for a later tensor of its size once every reference to
it is gone.

"Gone" is read from the buffer's reference count: every view of it, every
tensor made from it (`torch.from_numpy` keeps the array it was given, which
keeps its owner) holds one. A buffer is reused only when the pool's own
reference is the last; whatever Python or torch still holds keeps it out of
reach. Idle buffers beyond `idle_bytes` are let go, and all of them with the
pool (`close`, at the end of a reload).
"""

from __future__ import annotations

import sys
import threading

# References to a pooled buffer while `take` looks at it with nothing else holding it: the pool's list, the loop
# variable, and `sys.getrefcount`'s own argument.
_ONLY_THE_POOL = 3


class RebuildBuffers:
    """A pool of host buffers (numpy uint8 arrays), each reused for a request of its exact size once free.

    Attributes:
        idle_bytes: the most bytes kept in buffers nothing refers to; idle buffers beyond it are dropped.
        reused: buffers handed out again (for the tests and the curious).
        allocated: buffers allocated.
    """

    def __init__(self, idle_bytes: int = 512 << 20) -> None:
        self.idle_bytes = idle_bytes
        self.reused = 0
        self.allocated = 0
        self._buffers: list = []  # oldest first
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """A writable uint8 array of NBYTES: a free pooled buffer of that size, else a new one (then pooled)."""
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        with self._lock:
            found, idle, keep = None, 0, []
            for buffer in self._buffers:
                if sys.getrefcount(buffer) > _ONLY_THE_POOL:
                    keep.append(buffer)  # in use
                elif found is None and buffer.size == nbytes:
                    found = buffer
                elif idle + buffer.size <= self.idle_bytes:
                    idle += buffer.size
                    keep.append(buffer)
                # else: idle beyond the limit, dropped (freed once the loop lets go of it)
            buffer = None  # the loop's reference, before the caller's count starts
            if found is None:
                found = np.empty(nbytes, dtype=np.uint8)
                self.allocated += 1
            else:
                self.reused += 1
            keep.append(found)
            self._buffers = keep
            return found

    def close(self) -> None:
        """Let go of every buffer (those still referred to live on with their users)."""
        with self._lock:
            self._buffers = []
