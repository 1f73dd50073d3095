"""A run pushed to a Hub repo, a folder per step: `hf://org/run/step_120`, read at one commit.

The layout is the run folder as the trainer wrote it (`hf upload org/run run/step_120 step_120` after each
step, one commit per step), the same as in a bucket (`delta.remote`), and for the same reason: a delta's base
is the folder of its name beside it, read at the same commit, so one commit id pins the whole chain. (A step
per commit at the repo's root would leave each earlier step's files behind, since `hf upload` adds and does
not delete, and a delta would have to name its base's commit, which the trainer learns only after pushing.)

The step's folder, and each base folder back to the chain's full step, are taken from the Hub cache at the
commit (`snapshot_download` of that folder): a file whose blob the cache holds (the same LFS sha256, from any
earlier commit) is linked, not fetched again, so a host that loaded the previous steps fetches only the new
delta file. The step is then read from `snapshots/<commit>/<folder>` as a local run is.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path, PurePosixPath

from layerwise_cli.checkpoint.delta.format import Delta
from layerwise_cli.checkpoint.delta.read import delta_file, read_delta
from layerwise_cli.checkpoint.hub.pin import hub_error, pin_commit, repo_cache_folder
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError

SCHEME = "hf://"


def is_hub_step(source: str) -> bool:
    """True for `hf://org/name/folder`: a step folder in a Hub repo."""
    return source.startswith(SCHEME) and len(source[len(SCHEME):].strip("/").split("/")) >= 3


def split_hub_step(source: str) -> tuple[str, str]:
    """(`org/name`, the step's folder in the repo) of `hf://org/name/folder`."""
    parts = source[len(SCHEME):].strip("/").split("/")
    return "/".join(parts[:2]), "/".join(parts[2:])


def hub_step_commit(source: str, revision: str | None) -> str:
    """The commit a Hub step folder is read at: REVISION (a branch, tag or commit; None: the default branch)
    resolved once (`pin_commit`). What the client hands to every server, rank, check and rollback."""
    repo_id, _ = split_hub_step(source)
    return pin_commit(repo_id, revision).commit


def open_hub_step(source: str, revision: str | None, max_links: int) -> tuple[Checkpoint, list[Delta], int]:
    """The step folder SOURCE at REVISION's commit, from the Hub cache: (the chain's full step, the deltas
    oldest first, the bytes fetched). No deltas when the folder holds a full step.

    Raises:
        LayerwiseError: one line naming the step: the repo, commit or folder not there, a base folder not
            in the commit, a chain that loops.
    """
    repo_id, folder = split_hub_step(source)
    commit = hub_step_commit(source, revision)
    before = _blob_bytes(repo_id)
    links: list[Delta] = []
    child = source
    while True:
        local = _folder_at(repo_id, commit, folder, child)
        if delta_file(local) is None:
            break
        if len(links) >= max_links:
            raise LayerwiseError(f"a chain of more than {max_links} deltas (a loop?): no full step at its start",
                                 where=source)
        links.append(read_delta(local))
        child = f"{SCHEME}{repo_id}/{folder}"
        folder = str(PurePosixPath(folder).parent / PurePosixPath(links[-1].base_location.rstrip("/")).name)
        folder = folder.removeprefix("./")
    base = replace(open_checkpoint(str(local)), source=f"{SCHEME}{repo_id}/{folder}", kind="hub", commit=commit,
                   revision=commit)
    return base, list(reversed(links)), max(0, _blob_bytes(repo_id) - before)


def _folder_at(repo_id: str, commit: str, folder: str, child: str) -> Path:
    """FOLDER's files at COMMIT in the Hub cache (fetched unless their blobs are there); CHILD names the step
    that needs it in the message when the commit has no such folder."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    where = f"{SCHEME}{repo_id}/{folder}"
    try:
        root = Path(snapshot_download(repo_id, revision=commit, allow_patterns=[f"{folder}/*"]))
    except Exception as exc:
        raise hub_error(exc, repo_id, commit) from exc
    local = root / folder
    if not local.is_dir() or not any(local.iterdir()):
        if child == where:
            raise LayerwiseError(f"no folder {folder} in {repo_id} at commit {commit}", where=where)
        raise LayerwiseError(f"its base {where} is not there at commit {commit}: a delta is rebuilt from its base "
                             "step", where=child)
    return local


def _blob_bytes(repo_id: str) -> int:
    """The bytes in the Hub cache's blobs of REPO_ID (what a fetch adds)."""
    blobs = repo_cache_folder(repo_id) / "blobs"
    return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else 0
