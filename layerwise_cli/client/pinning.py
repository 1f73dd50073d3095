"""One commit per operation, on the client: a Hub source's revision resolved once, before anything else."""

from __future__ import annotations

from dataclasses import replace

from layerwise_cli.checkpoint.hub_pin import HubPin, is_commit
from layerwise_cli.checkpoint.sources import looks_like_repo_id, pin_source
from layerwise_cli.worker.rpc import ReloadOptions


def pin_reload(source: str, options: ReloadOptions) -> tuple[ReloadOptions, HubPin | None]:
    """OPTIONS with a Hub SOURCE's revision replaced by its commit, and the pin; a local path as it is.

    Called where an operation starts (the `reload` command before its engine starts or before any server is
    pre-flighted, `reload_servers`, the Python API's `reload`): every later step (each rank, each server's
    pre-flight, the reload, `--verify`, the rollback, a fleet going back) reads the commit `options.revision`
    then names, and a ref moved meanwhile changes nothing. A revision that already is a commit is used as it is,
    with no request (a caller that pinned it, or a user who gave one).

    Raises:
        LayerwiseError: one line naming the repo and revision (or commit): not found, vanished, unreachable.
    """
    if not looks_like_repo_id(source):
        return options, None
    if is_commit(options.revision):
        assert options.revision is not None
        return options, HubPin(source, options.revision)
    pin = pin_source(source, options.revision)
    assert pin is not None
    return replace(options, revision=pin.commit), pin
