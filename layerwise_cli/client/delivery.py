"""How a reload's bytes arrive, decided once per operation beside its pin.

One of four ways, chosen where the operation starts (`plan_operation`) and carried in
`ReloadOptions.delivery` to every later step, so that no layer re-derives it:

- `local`: a local folder or file; the workers read it where it is.
- `download`: a Hub repo the in-process engine starts on (no other `--model`): fetched whole into the Hub cache
  first, with huggingface_hub's progress bar, then read as a local folder.
- `prefetch`: a Hub repo reloaded into an in-process engine started on another model: its commit's shards are
  fetched whole, by range over several connections, while the engine starts (`client/engine/prefetch.py`); the
  workers then find it in the cache.
- `stream`: everything else, a URL (`s3://`, `gs://`, `az://`, `https://`), a Hub run's step (`hf://org/run/step_N`,
  what the host's cache lacks), a Hub repo into running servers
  (`--url`, `watch`, the Python API) or with `--bounded-disk`: each worker fetches exactly the byte ranges it
  hands over, in layer order, a window ahead (`worker/stream/remote_stream.py`); what a commit's or a store's cache
  already holds is read from there.
"""

from __future__ import annotations

from dataclasses import replace

from layerwise_cli.checkpoint.delta.source import is_remote_step
from layerwise_cli.checkpoint.hub.pin import HubPin, is_commit
from layerwise_cli.checkpoint.sources import looks_like_repo_id
from layerwise_cli.client.pinning import pin_reload
from layerwise_cli.worker.rpc import DELIVERIES, ReloadOptions

LOCAL, DOWNLOAD, PREFETCH, STREAM = DELIVERIES


def decide_delivery(source: str, *, engine_model: str | None, in_process: bool, bounded_disk: bool) -> str:
    """How SOURCE's bytes arrive (one of `DELIVERIES`).

    Args:
        source: what is reloaded, as the user named it.
        engine_model: the model an in-process engine starts on (None: SOURCE itself, or no engine starts here).
        in_process: the engine runs in this process and starts for this operation (the `reload` command without
            `--url`); False for running servers, `watch` and the Python API on an engine already up.
        bounded_disk: keep nothing on disk beyond what the reload hands over (`--bounded-disk`).
    """
    if is_remote_step(source):
        return STREAM
    if not looks_like_repo_id(source):
        return LOCAL
    if in_process and engine_model in (None, source):
        return DOWNLOAD
    return PREFETCH if in_process and not bounded_disk else STREAM


def plan_operation(source: str, options: ReloadOptions, *, engine_model: str | None = None,
                   in_process: bool = False) -> tuple[ReloadOptions, HubPin | None]:
    """OPTIONS pinned (`pin_reload`: a Hub revision resolved to its commit, a URL's objects to their ETags) and
    with the operation's `delivery` decided; the Hub pin, if any.

    Called where an operation starts (the `reload` command, `reload --url`, the Python API's `reload` and
    `reload_servers`); options that carry a delivery were planned already and are returned as they are, with no
    request: one pin per operation, taken once.

    Raises:
        LayerwiseError: one line naming the repo and revision, or the URL: not found, vanished, unreachable.
    """
    if options.delivery is not None:
        # Planned already where the operation started: its pin stands, and nothing is asked again.
        commit = options.revision if looks_like_repo_id(source) and is_commit(options.revision) else None
        return options, None if commit is None else HubPin(source, commit)
    options, pin = pin_reload(source, options)
    delivery = decide_delivery(source, engine_model=engine_model, in_process=in_process,
                               bounded_disk=options.bounded_disk)
    return replace(options, delivery=delivery), pin
