"""The last pre-flight plan of a worker, reused while the source keeps the same tensors in the same places.

A trainer writes every step's checkpoint with the same tensor names, dtypes,
shapes, shards and offsets: only the bytes change. The rank's plan and
pre-flight (which tensors this rank holds, the engine module each feeds, the
check against the engine's parameters) depend on nothing else, so a worker
keeps the last one, keyed by that structure, the source's config and the
pre-flight options. Header metadata (and so header digests) is not part of
the key: it does not change the plan. The engine's model and place are the
worker's own and never change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.worker.state.worker_state import kept_on

_ATTRIBUTE = "_layerwise_plan_cache"


def structure_key(checkpoint: Checkpoint, *options: object) -> tuple:
    """What a rank's plan of CHECKPOINT depends on: every tensor's place and shape, the config, OPTIONS."""
    config = json.dumps(checkpoint.config, sort_keys=True, default=str) if checkpoint.config is not None else None
    return (checkpoint.kind, tuple((shard.name, shard.tensors) for shard in checkpoint.shards), config, options)


@dataclass
class _Entry:
    key: tuple
    plan: object  # rank_plan.WorkerPlan
    notes: tuple[str, ...]


class PlanCache:
    """One worker's last plan (a single entry: a new structure replaces it)."""

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        self.hits = 0

    def get(self, key: tuple):
        """(plan, pre-flight notes) made for KEY, or None."""
        entry = self._entry
        if entry is None or entry.key != key:
            return None
        self.hits += 1
        return entry.plan, list(entry.notes)

    def put(self, key: tuple, plan, notes: list[str]) -> None:
        self._entry = _Entry(key, plan, tuple(notes))

    def clear(self) -> None:
        self._entry = None


def plan_cache_of(worker) -> PlanCache:
    """The worker's cache, made on first use."""
    return kept_on(worker, _ATTRIBUTE, PlanCache)
