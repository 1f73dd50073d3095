"""The one user-facing error type, and the table that maps library errors onto it."""

from __future__ import annotations


class LayerwiseError(Exception):
    """A handled failure: the CLI prints `Error: <message>` and exits 1.

    The message names the file or server concerned and what is wrong.
    """

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        self.what = message
        super().__init__(f"{where}: {message}" if where else message)


class UsageError(LayerwiseError):
    """A bad combination of arguments: exit code 2."""


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
    for exc_type, render in _mappings():
        if isinstance(exc, exc_type):
            return LayerwiseError(render(exc), where=where)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return LayerwiseError(f"{type(exc).__name__}: {text}", where=where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0].strip() if text else type(exc).__name__


def _mappings() -> list[tuple[type[BaseException], object]]:
    # Imported here so that `--help` stays free of huggingface_hub/requests.
    table: list[tuple[type[BaseException], object]] = []
    try:
        from huggingface_hub import errors as hf_errors

        table += [
            (hf_errors.RevisionNotFoundError, lambda e: "revision not found on the Hub"),
            (hf_errors.EntryNotFoundError, lambda e: "file not found in the repo: " + _first_line(e)),
            (hf_errors.GatedRepoError, lambda e: "repo is gated: log in with an authorised token"),
            (hf_errors.RepositoryNotFoundError, lambda e: "repo not found on the Hub (or not visible with this token)"),
            (hf_errors.LocalEntryNotFoundError, lambda e: "not in the local Hub cache and the Hub cannot be reached (HF_HUB_OFFLINE?)"),
            (hf_errors.OfflineModeIsEnabled, lambda e: "HF_HUB_OFFLINE=1 and the file is not in the local cache"),
            (hf_errors.NotASafetensorsRepoError, lambda e: "no model.safetensors or model.safetensors.index.json in the repo"),
            (hf_errors.SafetensorsParsingError, lambda e: "invalid safetensors header: " + _first_line(e)),
            (hf_errors.HfHubHTTPError, lambda e: "Hub request failed: " + _first_line(e)),
        ]
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        pass
    try:
        import httpx

        table += [
            (httpx.TimeoutException, lambda e: "timed out talking to the server"),
            (httpx.ConnectError, lambda e: "cannot connect: " + _first_line(e)),
            (httpx.HTTPError, lambda e: "network failure: " + _first_line(e)),
        ]
    except ImportError:  # pragma: no cover
        pass
    try:
        import requests

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
