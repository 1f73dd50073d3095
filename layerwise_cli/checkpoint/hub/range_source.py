"""The Hub as a `RangeSource`: a repo at one commit, read by range over huggingface_hub's client, kept in its cache."""

from __future__ import annotations

from pathlib import Path

from layerwise_cli.checkpoint.fetch.partial_blob import PartialBlob
from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.fetch.range_source import RangeSource, Write
from layerwise_cli.checkpoint.hub.http_range import stream_range
from layerwise_cli.checkpoint.hub.pin import HubPin, hub_error, repo_cache_folder
from layerwise_cli.errors import LayerwiseError


class HubSource:
    """A Hub repo at one commit: huggingface_hub's metadata and HTTP client, files kept in the Hub cache.

    Args:
        pin: the repo and commit; no request names a branch.
        cache_dir: the Hub cache (None: huggingface_hub's `HF_HUB_CACHE`).
        token: as huggingface_hub takes it; sent only to the Hub's origin.
        policy: stall bound, retries and backoff.
    """

    def __init__(self, pin: HubPin, *, cache_dir: str | Path | None = None, token: str | bool | None = None,
                 policy: FetchPolicy | None = None) -> None:
        from huggingface_hub.utils import build_hf_headers  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        self.pin, self.token, self.policy = pin, token, policy or FetchPolicy()
        self.repo_folder = repo_cache_folder(pin.repo_id, cache_dir)
        self._headers = build_hf_headers(token=token)

    def metadata(self, filename: str) -> tuple[str, int]:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        try:
            # With huggingface_hub's retries on 429/5xx: a fetch is worth waiting for (a 404 is not retried).
            meta = get_hf_file_metadata(hf_hub_url(self.pin.repo_id, filename, revision=self.pin.commit),
                                        token=self.token, retry_on_errors=True)
        except Exception as exc:
            raise hub_error(exc, self.pin.repo_id, self.pin.commit) from exc
        if meta.commit_hash and meta.commit_hash != self.pin.commit:
            raise LayerwiseError(f"the Hub answered for commit {meta.commit_hash}", where=self.where(filename))
        if not meta.etag or meta.size is None:
            raise LayerwiseError("the Hub gave no sha256 (ETag) or size for the file", where=self.where(filename))
        return meta.etag, meta.size

    def fetch(self, filename: str, identity: str, start: int, end: int, write: Write) -> None:
        # The commit pins the bytes (the sha256 is checked once the file is whole, `finish`).
        from huggingface_hub import hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        url = hf_hub_url(self.pin.repo_id, filename, revision=self.pin.commit)
        stream_range(url, start, end, write, headers=self._headers, policy=self.policy, where=self.where(filename))

    def open_blob(self, filename: str, identity: str, size: int, *, keep: bool) -> PartialBlob:
        return PartialBlob(self.repo_folder, filename, identity, size, keep=keep, where=self.where(filename))

    def finish(self, blob: PartialBlob) -> None:
        blob.finish(self.pin.commit)

    def where(self, filename: str) -> str:
        return f"{self.pin}/{filename}"


def range_source(pin: HubPin | RangeSource, *, cache_dir: str | Path | None = None) -> RangeSource:
    """PIN as a `RangeSource`: a Hub commit read through `HubSource` (in CACHE_DIR), or a source already one."""
    return HubSource(pin, cache_dir=cache_dir) if isinstance(pin, HubPin) else pin
