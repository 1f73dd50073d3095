"""A step written on this machine, uploaded under a URL prefix (`s3://bucket/run/step_3`), its marker last."""

from __future__ import annotations

from pathlib import Path

from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.store.objects import display_url, open_store, store_error
from layerwise_cli.errors import LayerwiseError


def upload_step(folder: Path, url: str, marker: str | None = None) -> str:
    """Put every file of FOLDER under URL (one object each, same names), MARKER (empty) after all of them.

    Each object is written whole or not at all (the store's own put); a reader that waits for MARKER, as
    `watch --marker` does, never sees a step in part.

    Args:
        folder: the step on this machine (`save_checkpoint`'s directory).
        url: the step's prefix in the store (`s3://bucket/run/step_3`, `gs://...`, `az://...`).
        marker: the name of an empty object put last (None: none).

    Returns:
        URL, without a trailing slash.

    Raises:
        LayerwiseError: the store refused a put (one line naming the object), or obstore is missing.
    """
    url = url.rstrip("/")
    store = open_store(url, FetchPolicy())
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != marker)
    if not files:
        raise LayerwiseError("no files to upload", where=str(folder))
    for path in files:
        try:
            obstore.put(store, path.name, path)
        except Exception as exc:  # noqa: BLE001 - one line naming the object
            raise store_error(exc, f"{display_url(url)}/{path.name}") from None
    if marker:
        try:
            obstore.put(store, marker, b"")
        except Exception as exc:  # noqa: BLE001 - one line naming the object
            raise store_error(exc, f"{display_url(url)}/{marker}") from None
    return url
