"""Sources by URL (`s3://`, `gs://`, `az://`, `https://`): obstore's ranged reads, pinned to the ETags read first.

One client serves every store: obstore (the Python binding of the Rust `object_store` crate that Apache Arrow,
DataFusion and Polars use): S3 and its compatibles, GCS, Azure and plain HTTP(S) servers, with ranged and
concurrent reads, conditional requests (`If-Match`) and the stores' own credential chains (`AWS_*`,
`GOOGLE_*`, `AZURE_*` environment variables; `AWS_ENDPOINT_URL` for an S3-compatible server). It is an optional
dependency (`pip install 'layerwise[storage]'`): a URL source without it fails with one line saying so.

`StoreSource` is a `range_source.RangeSource`: `RangeFetcher` fetches a store's files by the same window,
order and resume as a Hub commit's, and keeps what arrives in layerwise's store cache, keyed by each object's
pinned identity (unless bounded disk). Every request after the first read of an object names the identity read
then (`If-Match` on its ETag, or `If-Unmodified-Since` where a server gives no ETag): an object overwritten in
the middle of an operation is refused, naming it.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

from layerwise_cli.checkpoint.fetch.partial_blob import PartialBlob
from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.fetch.range_source import Write
from layerwise_cli.errors import LayerwiseError

# The schemes obstore's `from_url` reads (gs/az/abfs: Google Cloud Storage and Azure, the same client).
STORE_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"})
INSTALL_HINT = "reading a source by URL needs obstore: pip install 'layerwise[storage]'"
# An identity with no ETag: the object's Last-Modified, sent back as `If-Unmodified-Since`.
_MODIFIED_PREFIX = "modified:"


class MissingObject(LayerwiseError):
    """The store has no such object (or no such bucket: a store answers both with 404 to a read)."""


def is_missing(exc: BaseException) -> bool:
    """True for `MissingObject`: what a caller may treat as an optional file's absence."""
    return isinstance(exc, MissingObject)


def is_store_url(source: str) -> bool:
    """True for a source given as a URL layerwise reads through an object store client (`s3://bucket/prefix`)."""
    parts = urlsplit(source)
    return parts.scheme.lower() in STORE_SCHEMES and bool(parts.netloc)


def display_url(url: str) -> str:
    """URL without a user, password or query string: how messages and reports name it (never a credential)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}".rstrip("/")


class StoreSource:
    """The files under one URL prefix, each pinned to the identity it had when first read.

    Args:
        url: `s3://bucket/prefix`, `gs://...`, `az://...` or `https://host/path/`.
        pinned: filename -> (identity, size) read earlier in the operation (the checkpoint's headers); a file
            not in it is pinned by its first request here.
        policy: stall bound (per read and per connect), retries and backoff.
    """

    def __init__(self, url: str, *, pinned: dict[str, tuple[str, int]] | None = None,
                 policy: FetchPolicy | None = None) -> None:
        self.url, self.policy = url, policy or FetchPolicy()
        self.shown = display_url(url)
        self.pinned = dict(pinned or {})
        self.store = open_store(url.rstrip("/"), self.policy)

    # RangeSource.

    def metadata(self, filename: str) -> tuple[str, int]:
        if filename not in self.pinned:
            import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

            try:
                meta = obstore.head(self.store, filename)
            except Exception as exc:
                raise store_error(exc, self.where(filename)) from exc
            self.pinned[filename] = (identity_of(meta), int(meta["size"]))
        return self.pinned[filename]

    def fetch(self, filename: str, identity: str, start: int, end: int, write: Write) -> None:
        """Bytes `[start, end)` of FILENAME at IDENTITY, in chunks; a drop resumes at the last byte received."""
        pos, failures = start, 0
        while pos < end:
            before = pos
            try:
                pos = self._one_try(filename, identity, pos, end, write)
                if pos < end:
                    raise ConnectionError(f"the body ended at byte {pos} of {end}")
            except LayerwiseError:
                raise
            except Exception as exc:
                if _fatal(exc):
                    raise store_error(exc, self.where(filename), identity) from exc
                # A try that brought bytes resumes at once; one that brought none waits, and counts.
                failures = 0 if pos > before else failures + 1
                if failures and _timed_out(exc):
                    raise LayerwiseError(f"no bytes for {self.policy.stall_s:g} s: the fetch stalled",
                                         where=self.where(filename)) from exc
                if failures > self.policy.retries:
                    raise store_error(exc, self.where(filename), identity) from exc
                if failures:
                    time.sleep(self.policy.wait_s(failures))

    def open_blob(self, filename: str, identity: str, size: int, *, keep: bool) -> PartialBlob:
        """FILENAME's file in the store cache (`store_cache_folder`), keyed by its pinned identity (`cache_key`):
        kept, resumed, and read from there by a later operation at the same ETag; `keep=False` (bounded disk):
        a private sparse file deleted on close."""
        return PartialBlob(store_cache_folder(self.url), filename, cache_key(filename, identity, size), size,
                           keep=keep, where=self.where(filename), verify=False)

    def cached(self, filename: str) -> Path | None:
        """FILENAME's whole file in the store cache at its pinned identity (kept by an earlier fetch), or None."""
        identity, size = self.metadata(filename)
        path = store_cache_folder(self.url) / "blobs" / cache_key(filename, identity, size)
        return path if path.is_file() and path.stat().st_size == size else None

    def finish(self, blob: PartialBlob) -> None:
        """A complete kept file moves into the cache's `blobs/`; nothing to verify: every request named the
        identity (`If-Match`), so the bytes are that object's."""
        blob.finish(None)

    def where(self, filename: str) -> str:
        return f"{self.shown}/{filename}"

    # Reads of whole small files and header ranges (`store.headers`).

    def read(self, filename: str, start: int = 0, end: int | None = None) -> tuple[bytes, str, int]:
        """Bytes `[start, end)` of FILENAME (the whole file when END is None), its identity and its size.

        The first read of a file pins it; later reads name that identity.
        """
        import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        options: dict = {}
        if filename in self.pinned:
            options.update(conditions(self.pinned[filename][0]))
        if end is not None:
            options["range"] = (start, end)
        try:
            result = obstore.get(self.store, filename, options=options)
            data = bytes(result.bytes())
        except Exception as exc:
            raise store_error(exc, self.where(filename), self.pinned.get(filename, ("", 0))[0] or None) from exc
        identity, size = identity_of(result.meta), int(result.meta["size"])
        self.pinned.setdefault(filename, (identity, size))
        return data, identity, size

    def bucket_missing(self) -> bool:
        """True when the store says the bucket (or container) itself does not exist."""
        import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        try:
            obstore.list_with_delimiter(self.store, None)
        except Exception as exc:  # noqa: BLE001 - only asked to tell a missing bucket from a missing key
            return "NoSuchBucket" in str(exc) or "ContainerNotFound" in str(exc)
        return False

    def _one_try(self, filename: str, identity: str, pos: int, end: int, write: Write) -> int:
        import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        result = obstore.get(self.store, filename, options={"range": (pos, end), **conditions(identity)})
        for chunk in result.stream(min_chunk_size=1 << 20):
            view = memoryview(chunk)[: end - pos]
            if len(view):
                write(pos, view)
                pos += len(view)
            if pos >= end:
                break
        return pos


def store_cache_folder(url: str) -> Path:
    """Where the objects fetched from under URL are kept: `<cache_root>/store/<16 hex>`, one folder per prefix,
    named by a digest of its URL without credentials (`blobs/<cache_key>`, as the Hub cache lays out blobs)."""
    from layerwise_cli.cache_root import cache_root  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    digest = hashlib.sha256(display_url(url).encode()).hexdigest()[:16]
    return cache_root() / "store" / digest


def cache_key(filename: str, identity: str, size: int) -> str:
    """The name an object's bytes are kept under: a digest of its name, its pinned identity (ETag) and its size.

    An ETag is an object's version, not a digest of its bytes that holds across objects (a multipart upload's,
    GCS's and Azure's are opaque): the name and size are part of the key.
    """
    return hashlib.sha256(f"{filename}\n{identity}\n{size}".encode()).hexdigest()


def open_store(url: str, policy: FetchPolicy):
    """obstore's store for URL, credentials from the environment (never passed through layerwise).

    `SSL_CERT_FILE` (or `AWS_CA_BUNDLE`), when set, is trusted beside the system roots: a server behind a
    private certificate authority.

    Raises:
        LayerwiseError: obstore is not installed, or the URL or the configuration is refused (one line).
    """
    try:
        from obstore.store import from_url  # noqa: PLC0415 - optional: the ImportError is handled here
    except ImportError:
        raise LayerwiseError(INSTALL_HINT, where=display_url(url)) from None
    # No byte for the stall bound, connecting or between two reads of a body, is a timeout (obstore retries it).
    stall = timedelta(seconds=policy.stall_s)
    client: dict = {"connect_timeout": stall, "read_timeout": stall, "timeout": "86400s",
                    "allow_http": _allow_http(url)}
    bundle = os.environ.get("SSL_CERT_FILE") or os.environ.get("AWS_CA_BUNDLE")
    if bundle and Path(bundle).is_file():
        client["root_certificate"] = Path(bundle).read_text()
    retry = {"max_retries": policy.retries, "retry_timeout": timedelta(seconds=policy.stall_s * (policy.retries + 1)),
             "backoff": {"init_backoff": timedelta(seconds=policy.backoff_s),
                         "max_backoff": timedelta(seconds=policy.max_backoff_s), "base": 2}}
    try:
        return from_url(url, client_options=client, retry_config=retry)
    except Exception as exc:
        raise store_error(exc, display_url(url)) from exc


def _allow_http(url: str) -> bool:
    # Plain HTTP only where the user asked for it: an http:// URL, or an S3 endpoint configured as http://.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    return url.startswith("http://") or endpoint.startswith("http://") or \
        os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true")


def identity_of(meta) -> str:
    """An object's identity as its store reports it: the ETag, else its Last-Modified time."""
    etag = meta.get("e_tag")
    if etag:
        return str(etag)
    modified = meta.get("last_modified")
    if modified is None:
        raise LayerwiseError("the server gave neither an ETag nor a Last-Modified for the object: it cannot be "
                             "pinned", where=str(meta.get("path")))
    return _MODIFIED_PREFIX + modified.isoformat()


def conditions(identity: str) -> dict:
    """obstore's `GetOptions` that make a request fail (412) unless the object still has IDENTITY."""
    if identity.startswith(_MODIFIED_PREFIX):
        return {"if_unmodified_since": datetime.fromisoformat(identity.removeprefix(_MODIFIED_PREFIX))}
    return {"if_match": identity}


def _fatal(exc: BaseException) -> bool:
    # Answers a retry cannot change: obstore already retried what it could (5xx, 429, timeouts before a byte).
    from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    return isinstance(exc, PreconditionError | PermissionDeniedError | UnauthenticatedError | FileNotFoundError)


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def store_error(exc: BaseException, where: str, identity: str | None = None) -> LayerwiseError:
    """One line naming the object (WHERE) for an obstore failure; the store's own text is cut to its first line.

    Credentials are never in it: obstore signs requests in headers, and the URL is shown without user,
    password or query string.
    """
    if isinstance(exc, LayerwiseError):
        return exc
    try:
        from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError  # noqa: PLC0415 - optional: the ImportError is handled here
    except ImportError:
        return LayerwiseError(INSTALL_HINT, where=where)
    if isinstance(exc, PreconditionError):
        pinned = f" (pinned at {identity})" if identity else ""
        return LayerwiseError(f"the object changed since this operation first read it{pinned}: refused, not "
                              "mixing two versions", where=where)
    if isinstance(exc, FileNotFoundError):
        return MissingObject("no such object", where=where)
    if "NoSuchBucket" in str(exc) or "ContainerNotFound" in str(exc):
        return LayerwiseError("no such bucket", where=where)
    # A listing's or a bulk delete's refusal reaches obstore's generic error, with the store's own words.
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or any(
            word in str(exc) for word in ("403 Forbidden", "AccessDenied", "Access Denied", "SignatureDoesNotMatch",
                                          "InvalidAccessKeyId")):
        return LayerwiseError("access denied: check the store's credentials (AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)",
                              where=where)
    if "error sending request" in str(exc):
        # reqwest's words for a connection refused, reset or not resolved (obstore retried it already).
        return LayerwiseError("cannot reach the store (connection refused, reset or host not found): check "
                              "the URL, AWS_ENDPOINT_URL and the network", where=where)
    return LayerwiseError(_first_line(exc), where=where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # A URL with a user or password, or a signed query string, is never repeated.
    text = re.sub(r"//[^/@\s]+@", "//", text)
    return re.sub(r"(https?://[^\s?]+)\?\S*", r"\1", text)
