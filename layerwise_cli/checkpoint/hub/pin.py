"""One commit per operation: resolve a Hub revision to its commit once, and name that commit in every error."""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.errors import LayerwiseError, describe_exception

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# What a pinned commit the Hub no longer has is said to be (after `org/name@<commit>: `).
VANISHED = "this commit is no longer on the Hub (force-pushed away, or the repo was deleted)"


def is_commit(revision: str | None) -> bool:
    """True for a full 40-hex commit id: a revision that never moves, so it is used as is."""
    return bool(revision) and bool(_COMMIT_RE.match(revision or ""))


@dataclass(frozen=True)
class HubPin:
    """A Hub repo pinned to one commit: what one operation reads, from its start to its rollback.

    `str(pin)` is `org/model@<commit>`, the form a worker records as what it holds and a report names;
    `HubPin.parse` reads it back.

    Attributes:
        repo_id: `org/name`.
        commit: the 40-hex commit every request of the operation names.
        revision: what the user asked for (a branch, tag or commit; None: the default branch), for messages.
    """

    repo_id: str
    commit: str
    revision: str | None = None

    def __post_init__(self) -> None:
        if not is_commit(self.commit):
            raise LayerwiseError(f"not a 40-hex commit id: {self.commit!r}", where=self.repo_id)

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.commit}"

    @classmethod
    def parse(cls, text: str) -> HubPin:
        """Read `org/model@<commit>` back (raises `LayerwiseError` on anything else)."""
        repo_id, _, commit = text.rpartition("@")
        if not repo_id or not is_commit(commit):
            raise LayerwiseError("not a pinned Hub source (org/name@<40-hex commit>)", where=text)
        return cls(repo_id, commit)


def offline() -> bool:
    """True when HF_HUB_OFFLINE=1: Hub sources are read from the local cache only."""
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    return constants.is_offline_mode()


def pin_commit(repo_id: str, revision: str | None = None, *, token: str | bool | None = None) -> HubPin:
    """Resolve `revision` of a Hub repo to its commit: the one request of an operation that names a branch.

    One HEAD of `config.json` at `revision` (huggingface_hub's `get_hf_file_metadata`, without its download
    retries: it fails fast and tells a missing repo from a missing revision); its `X-Repo-Commit` is the commit,
    also on the 404 of a repo without `config.json`. The commit is recorded in the Hub cache as
    `refs/<revision>`, as `hf_hub_download` does, so that an `HF_HUB_OFFLINE=1` run finds it. Offline, the
    commit is read from that record.

    Args:
        repo_id: `org/name`.
        revision: a branch, tag or commit; None for the default branch.
        token: as huggingface_hub takes it (None: `HF_TOKEN` or the stored login).

    Returns:
        The pin: pass `pin.commit` as the revision of every later call (every rank, server and rollback).

    Raises:
        LayerwiseError: one line naming the repo and revision (or commit): not found, vanished, unreachable.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    where = f"{repo_id}@{revision}" if revision else repo_id
    if offline():
        return HubPin(repo_id, _cached_commit(repo_id, revision, where), revision)
    try:
        commit = get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision), token=token).commit_hash
    except RemoteEntryNotFoundError as exc:  # a repo without config.json still names its commit
        commit = exc.response.headers.get("X-Repo-Commit")
    except Exception as exc:
        raise hub_error(exc, repo_id, revision) from exc
    if not is_commit(commit):
        raise LayerwiseError("the Hub named no commit for this revision (no X-Repo-Commit header)", where=where)
    assert commit is not None
    if revision != commit:
        _record_ref(repo_id, revision or "main", commit)
    return HubPin(repo_id, commit, revision)


def hub_error(exc: BaseException, repo_id: str, revision: str | None) -> LayerwiseError:
    """A Hub failure as one line naming the repo and revision; a pinned commit the Hub no longer has says so.

    A commit that vanished (a force-push, a deleted repo) answers 404 like any missing revision; given a commit,
    the message names it and says what happened, rather than "revision not found".
    """
    where = f"{repo_id}@{revision}" if revision else repo_id
    if is_commit(revision) and commit_vanished(exc):
        return LayerwiseError(VANISHED, where=where)
    return describe_exception(exc, where=where)


def commit_vanished(exc: BaseException) -> bool:
    """True for the Hub's answer to a revision (or repo) it does not have: for a commit, it vanished."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    return isinstance(exc, RevisionNotFoundError | RepositoryNotFoundError)


def repo_cache_folder(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """The repo's folder in the Hub cache (`models--org--name`), as huggingface_hub lays it out."""
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.file_download import repo_folder_name  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    return Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _cached_commit(repo_id: str, revision: str | None, where: str) -> str:
    folder = repo_cache_folder(repo_id)
    if is_commit(revision):
        assert revision is not None
        return revision
    ref = folder / "refs" / (revision or "main")
    try:
        commit = ref.read_text(encoding="ascii").strip()
    except OSError:
        commit = ""
    if not is_commit(commit):
        raise LayerwiseError("not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it", where=where)
    return commit


def _record_ref(repo_id: str, revision: str, commit: str) -> None:
    # As huggingface_hub's `_cache_commit_hash_for_specific_revision`: atomic, and only when it changed. A cache
    # this process cannot write is no reason to fail an online operation.
    ref = repo_cache_folder(repo_id) / "refs" / revision
    try:
        if ref.is_file() and ref.read_text(encoding="ascii") == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(commit, encoding="ascii")
        os.replace(tmp, ref)
    except OSError:
        pass
