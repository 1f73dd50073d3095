"""The one user-facing error type, and the table that maps library errors onto it."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit


class LayerwiseError(Exception):
    """A handled failure: the CLI prints `Error: <message>` and exits 1.

    The message names the file or server concerned and what is wrong, on one
    line: `str(error)` is `"<where>: <what>"`.

    Args:
        message: what is wrong.
        where: the file, repo or server concerned (None: no single one).

    Attributes:
        where: as given.
        what: the message without `where`.
    """

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        self.what = message
        super().__init__(f"{where}: {message}" if where else message)


class UsageError(LayerwiseError):
    """A bad combination of arguments: exit code 2."""


def one_line(text: str) -> str:
    """TEXT with every run of whitespace, newlines included, made one space (for one-line errors and events)."""
    return " ".join(text.split())


def describe_exception(exc: BaseException, where: str | None = None) -> LayerwiseError:
    """Map a library exception onto a `LayerwiseError` with a one-line message.

    Subclasses are checked before their bases, so the most specific text wins.

    Args:
        exc: the exception raised by a library (Hub, HTTP, OS, JSON).
        where: the file, repo or server the operation was about.

    Returns:
        A `LayerwiseError` whose message is a single line.
    """
    if isinstance(exc, LayerwiseError):
        return exc
    exc = _reason(exc)
    for exc_type, render in _mappings():
        if isinstance(exc, exc_type):
            return LayerwiseError(render(exc), where=where)
    text = one_line(str(exc)) or type(exc).__name__
    return LayerwiseError(f"{type(exc).__name__}: {text}", where=where)


def _reason(exc: BaseException) -> BaseException:
    # huggingface_hub reports a failed HEAD (connection refused, timeout, HTTP
    # 5xx) as "not in the local cache", chained from the real failure: report
    # the real failure.
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415 - optional: the ImportError is handled here
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        return exc
    while isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0].strip() if text else type(exc).__name__


def _missing_file(exc: BaseException) -> str:
    # The Hub's 404 says only "Entry Not Found for url: ..."; name the file.
    response = getattr(exc, "response", None)
    url = str(getattr(response, "url", "") or "")
    marker = "/resolve/"
    if marker in url:
        path = urlsplit(url).path
        tail = path[path.index(marker) + len(marker):]
        filename = unquote(tail.partition("/")[2])
        if filename:
            return f"{filename} is not in the repo"
    return "file not found in the repo"


def _mappings() -> list[tuple[type[BaseException], object]]:
    # Imported here so that `--help` stays free of huggingface_hub and httpx.
    table: list[tuple[type[BaseException], object]] = []
    try:
        from huggingface_hub import errors as hf_errors  # noqa: PLC0415 - optional: the ImportError is handled here

        table += [
            (hf_errors.RevisionNotFoundError, lambda e: "revision not found on the Hub"),
            (hf_errors.LocalEntryNotFoundError,
             lambda e: "not in the local Hub cache, and the Hub cannot be reached (HF_HUB_OFFLINE=1?)"),
            (hf_errors.EntryNotFoundError, _missing_file),
            (hf_errors.GatedRepoError, lambda e: "repo is gated: log in with an authorised token"),
            (hf_errors.RepositoryNotFoundError,
             lambda e: "repo not found on the Hub (or not visible with this token)"),
            (hf_errors.OfflineModeIsEnabled, lambda e: "HF_HUB_OFFLINE=1 and the file is not in the local cache"),
            (hf_errors.NotASafetensorsRepoError,
             lambda e: "no model.safetensors or model.safetensors.index.json in the repo"),
            (hf_errors.SafetensorsParsingError, lambda e: "invalid safetensors header: " + _first_line(e)),
            (hf_errors.FileMetadataError,
             lambda e: "the server does not answer like the Hub (HF_ENDPOINT?): " + _first_line(e)),
            (hf_errors.HfHubHTTPError, lambda e: "Hub request failed: " + _first_line(e)),
        ]
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        pass
    # huggingface_hub 1.x talks through httpx, 2.x through httpx2: map both.
    for module in ("httpx2", "httpx"):
        try:
            http = __import__(module)
        except ImportError:
            continue
        table += [
            (http.TimeoutException, lambda e: "timed out talking to the server"),
            (http.ConnectError, lambda e: "cannot connect: " + _first_line(e)),
            (http.HTTPError, lambda e: "network failure: " + _first_line(e)),
        ]
    try:
        import requests  # noqa: PLC0415 - optional: the ImportError is handled here

        table += [
            (requests.Timeout, lambda e: "timed out talking to the server"),
            (requests.ConnectionError, lambda e: "cannot connect: " + _first_line(e)),
        ]
    except ImportError:
        pass
    table += [
        (FileNotFoundError, lambda e: "no such file or directory"),
        (IsADirectoryError, lambda e: "is a directory"),
        (PermissionError, lambda e: "permission denied"),
        (OSError, lambda e: e.strerror or _first_line(e)),
        (UnicodeDecodeError, lambda e: "not valid UTF-8"),
        (ValueError, _first_line),
    ]
    return table
