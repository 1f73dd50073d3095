"""One byte range of a Hub file over huggingface_hub's HTTP client: resumed after a drop, retried on 429/5xx."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType

from layerwise_cli.checkpoint.fetch.policy import RETRY_STATUSES, FetchPolicy
from layerwise_cli.errors import LayerwiseError, describe_exception


class _ShortBody(Exception):
    """The body ended before the range did, without an error from the HTTP library."""


def http_library() -> ModuleType:
    """The HTTP library huggingface_hub's shared client comes from: httpx (huggingface_hub 1.x) or httpx2 (2.x)."""
    from huggingface_hub.utils import get_session  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    return importlib.import_module(type(get_session()).__module__.split(".")[0])


def stream_range(
    url: str,
    start: int,
    end: int,
    write: Callable[[int, bytes], None],
    *,
    headers: dict[str, str],
    policy: FetchPolicy,
    where: str,
) -> int | None:
    """GET bytes `[start, end)` of a Hub file and hand each chunk to `write(offset, chunk)`, in order.

    The request goes through huggingface_hub's shared client (`get_session()`), which follows the Hub's
    redirect to its storage and, being httpx, drops the `Authorization` header when the redirect leaves the
    Hub's origin. Each try starts at the last byte received, so a dropped connection costs no byte twice; an
    expiring storage URL never bites, since each try asks the Hub's `/resolve/` again.

    Args:
        url: the file's `/resolve/<commit>/` URL (`hf_hub_url`).
        start: first byte.
        end: one past the last byte; clipped to the file's size as the server reports it.
        write: takes each chunk and its offset in the file.
        headers: `build_hf_headers(...)`: the token, if any, is in here and nowhere else.
        policy: stall bound, retries and backoff.
        where: the file as messages name it.

    Returns:
        The file's size from `Content-Range` (None if the server gave none).

    Raises:
        LayerwiseError: one line naming `where`: stalled, refused range, or the last failure after the retries.
    """
    http = http_library()
    pos, failures, size = start, 0, None
    while pos < end:
        try:
            size, end = _one_try(url, pos, end, write, headers, policy, where)
            return size
        except _Progress as progress:
            # A try that brought bytes resumes at once; one that brought none waits, and counts.
            failures = 0 if progress.pos > pos else failures + 1
            pos, size = progress.pos, progress.size if progress.size is not None else size
            if size is not None:
                end = min(end, size)
            if failures > policy.retries:
                raise describe_exception(progress.cause, where=where) from progress.cause
            if failures and pos < end:
                time.sleep(policy.wait_s(failures, progress.retry_after))
        except http.TimeoutException as exc:
            raise LayerwiseError(f"no bytes for {policy.stall_s:g} s: the fetch stalled", where=where) from exc
    return size


class _Progress(Exception):
    """A try ended early: how far it got, and why (a retryable answer or a dropped connection)."""

    def __init__(self, pos: int, size: int | None, cause: BaseException, retry_after: str | None = None) -> None:
        super().__init__(str(cause))
        self.pos, self.size, self.cause, self.retry_after = pos, size, cause, retry_after


def _one_try(
    url: str, pos: int, end: int, write: Callable[[int, bytes], None], headers: dict[str, str],
    policy: FetchPolicy, where: str,
) -> tuple[int | None, int]:
    from huggingface_hub.utils import get_session, hf_raise_for_status  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    http = http_library()
    request_headers = {**headers, "Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
    size = None
    try:
        with get_session().stream("GET", url, headers=request_headers, timeout=policy.stall_s,
                                  follow_redirects=True) as response:
            size = _content_range_size(response.headers.get("Content-Range"))
            if response.status_code == 416:  # the file is shorter than `pos`
                return size, pos
            if response.status_code in RETRY_STATUSES:
                response.read()
                try:
                    hf_raise_for_status(response)
                except Exception as exc:  # noqa: BLE001 - kept as the cause, raised after the last retry
                    raise _Progress(pos, size, exc, response.headers.get("Retry-After")) from None
            if response.status_code >= 400:
                response.read()  # hf_raise_for_status reads the error body
                hf_raise_for_status(response)
            _check_partial(response.status_code, response.headers.get("Content-Range"), pos, where)
            if size is not None:
                end = min(end, size)
            for chunk in response.iter_bytes():
                take = chunk[: end - pos]
                if take:
                    write(pos, take)
                    pos += len(take)
                if pos >= end:
                    return size, end
            raise _ShortBody(f"the body ended at byte {pos} of {end}")
    except (http.NetworkError, http.RemoteProtocolError, _ShortBody) as exc:
        if isinstance(exc, http.TimeoutException):
            raise
        raise _Progress(pos, size, exc) from None


def _check_partial(status: int, content_range: str | None, pos: int, where: str) -> None:
    if status != 206:
        # A server that ignores Range would send the whole file: stop here.
        raise LayerwiseError(
            f"the server ignored the byte range request (HTTP {status}); not downloading the whole file", where=where)
    first = (content_range or "").removeprefix("bytes ").partition("-")[0].strip()
    if first.isdigit() and int(first) != pos:
        raise LayerwiseError(f"the server sent bytes from {first}, not from the {pos} asked", where=where)


def _content_range_size(value: str | None) -> int | None:
    # "bytes 0-7/12345" or "bytes */12345": the part after "/" is the file size.
    total = (value or "").rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None
