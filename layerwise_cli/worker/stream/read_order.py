"""The order a worker reads parent layers in: layer order, with a large first or last layer moved inward.

vLLM's layerwise reload buffers each parent layer until its last tensor
arrives, and only that: once a layer is complete it is processed and its
buffer is gone. So the order of whole parent layers changes nothing in what
it buffers; only the order of tensors inside a layer and the splitting of a
layer do. That leaves one choice free, which matters for the pipeline:

- the first layer is read and checked before the engine can start, so a
  large one (the embedding) makes the engine wait for all of it;
- the last layer's record (its fingerprint, taken once vLLM has processed it)
  is taken after the stream, so a large one (an untied head) makes the
  caller wait for it.

Moving such a layer inward, behind (or ahead of) enough small layers for the
engine to work on while the reader deals with it, hides both. A layer vLLM
holds to the end of the stream (a padded vocabulary) keeps its place: when it
is read changes how long it is held. The prediction is made from the order
the stream really has, so it stays exact.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection

from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.shard_reader import layer_batches

# A first or last layer this many times the median layer is moved inward ...
_LARGE = 4
# ... past layers holding this share of its bytes (vLLM's loading and processing of them outlasts reading and
# checking the large one, on a CPU where vLLM processes about 1.5 GB/s and the check reads 6 to 10 GB/s).
_COVER = 0.5


def pipelined_order(stream: list[PlannedTensor], held: Collection[str] = ()) -> list[PlannedTensor]:
    """STREAM (in layer order) with a large first and a large last parent layer moved inward (see the module doc).

    Args:
        stream: tensors in layer order (each parent layer's tensors together).
        held: parent layers vLLM holds to the end of the stream: never moved.

    Returns:
        The same tensors, each parent layer's run unchanged, in the order to read them.
    """
    batches = layer_batches(stream)
    if len(batches) < 4 or len({batch[0].parent for batch in batches}) != len(batches):
        return list(stream)  # a layer split into several runs: leave the order alone
    sizes = [sum(item.entry.nbytes for item in batch) for batch in batches]
    median = statistics.median(sizes)
    order = list(range(len(batches)))
    if sizes[0] > _LARGE * median and batches[0][0].parent not in held:
        covered, at = 0, 1
        while at < len(order) - 1 and covered < _COVER * sizes[0]:
            covered += sizes[order[at]]
            at += 1
        order.insert(at, order.pop(0))
    last = order[-1]
    if sizes[last] > _LARGE * median and batches[last][0].parent not in held:
        covered, at = 0, len(order) - 1
        while at > 1 and covered < _COVER * sizes[last]:
            at -= 1
            covered += sizes[order[at]]
        order.insert(at, order.pop())
    return [item for index in order for item in batches[index]]
