"""After a server's reload, the KV blocks its previous weights computed: dropped once, by whoever can.

A prompt served from a prefix-cache block of the old weights would bring them
into an answer tagged with the new. vLLM's pause (`wait`, `abort`) clears the
caches once the engine is idle, and nothing runs after that while
layerwise's lease holds the pause (without the lease, anyone may have resumed
the server meanwhile). Otherwise `layerwise serve` resets the cache in the
reload's own engine-core step (`server/versioned_rpc.py`), and a server that
cannot gets a reset call of its own after the reload.
"""

from __future__ import annotations

from layerwise_cli.errors import one_line

KEPT = ("the prefix cache could not be reset (blocks still held); cached prompt prefixes may reuse KV computed "
        "with the previous weights")


def needs_reset(pause_mode: str, keeper) -> bool:
    """Whether the cache must be reset after the reload: not when a `wait` or `abort` pause under a lease that
    still holds (KEEPER, a `LeaseKeeper` or None) cleared it."""
    return not (pause_mode in ("wait", "abort") and keeper is not None and not keeper.lost)


def after_reload(client, asked: bool, needed: bool) -> list[str]:
    """Reset the cache unless the server did with the reload (ASKED, and CLIENT's
    `prefix_cache_reset_with_reload` says it took) or it is not NEEDED now; the warnings to report."""
    done = client.prefix_cache_reset_with_reload if asked else None
    if done is None and needed:
        return reset(client)
    return [KEPT] if done is False else []


def reset(client) -> list[str]:
    """Reset the server's prefix cache by a call of its own; the warnings to report if it could not be."""
    try:
        if not client.reset_prefix_cache():
            return [KEPT]
    except Exception as exc:  # noqa: BLE001 - a warning, not a failure
        return [f"the prefix cache could not be reset: {one_line(str(exc))}"]
    return []
