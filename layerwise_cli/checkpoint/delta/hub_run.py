"""A run pushed to a Hub repo, a folder per step: `hf://org/run/step_120`, read at one commit.

The layout is the run folder as the trainer wrote it (`hf upload org/run run/step_120 step_120` after each
step, one commit per step), the same as in a bucket (`delta.remote`), and for the same reason: a delta's base
is the folder of its name beside it, read at the same commit, so one commit id pins the whole chain. (A step
per commit at the repo's root would leave each earlier step's files behind, since `hf upload` adds and does
not delete, and a delta would have to name its base's commit, which the trainer learns only after pushing.)

The chain is walked on the commit's file list: a folder holding `delta.safetensors` is a link, and its base is
named in that file's header, read from this host's copy of its blob (any earlier commit's download of the same
LFS sha256) or else by range. Then the step's folder and each base folder back to the chain's full step are
taken from the Hub cache at the commit in one `snapshot_download`: a file whose blob the cache holds is linked,
not fetched again, and the others are fetched at the same time, so a host that loaded the previous steps
fetches only the new delta file, and one that missed several fetches their delta files together. The step is
then read from `snapshots/<commit>/<folder>` as a local run is.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path, PurePosixPath

from layerwise_cli.checkpoint.delta.format import DELTA_FILE, Delta
from layerwise_cli.checkpoint.delta.read import base_location_of, first_header_read, read_delta
from layerwise_cli.checkpoint.format.header import read_header_by_range, read_shard_header
from layerwise_cli.checkpoint.hub.pin import hub_error, pin_commit, repo_cache_folder
from layerwise_cli.checkpoint.hub.repo import read_hub_range
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

    The chain is walked on the commit's file list first (`_chain_folders`), then every folder of it is taken
    in one `snapshot_download`: the links a host missed are fetched at the same time.

    Raises:
        LayerwiseError: one line naming the step: the repo, commit or folder not there, a base folder not
            in the commit, a chain that loops.
    """
    repo_id, _ = split_hub_step(source)
    commit = hub_step_commit(source, revision)
    before = _blob_bytes(repo_id)
    folders = _chain_folders(repo_id, commit, _files_at(repo_id, commit), source, max_links)
    root = _fetched(repo_id, commit, folders)
    links = [read_delta(root / folder) for folder in folders[:-1]]
    base = replace(open_checkpoint(str(root / folders[-1])), source=f"{SCHEME}{repo_id}/{folders[-1]}", kind="hub",
                   commit=commit, revision=commit)
    return base, list(reversed(links)), max(0, _blob_bytes(repo_id) - before)


def _chain_folders(repo_id: str, commit: str, files: dict[str, tuple[int, str | None]], source: str,
                   max_links: int) -> list[str]:
    """The folders of SOURCE's chain at COMMIT, newest first, the last its full step: each delta's base read
    from its header (this host's copy of its blob, else by range), FILES the commit's (`_files_at`)."""
    folder = split_hub_step(source)[1]
    folders: list[str] = []
    child = source
    while True:
        where = f"{SCHEME}{repo_id}/{folder}"
        if not any(path.startswith(f"{folder}/") for path in files):
            if child == where:
                raise LayerwiseError(f"no folder {folder} in {repo_id} at commit {commit}", where=where)
            raise LayerwiseError(f"its base {where} is not there at commit {commit}: a delta is rebuilt from its "
                                 "base step", where=child)
        folders.append(folder)
        if f"{folder}/{DELTA_FILE}" not in files:
            return folders
        if len(folders) > max_links:
            raise LayerwiseError(f"a chain of more than {max_links} deltas (a loop?): no full step at its start",
                                 where=source)
        location = _base_of(repo_id, commit, files, folder)
        child = where
        folder = str(PurePosixPath(folder).parent / PurePosixPath(location.rstrip("/")).name).removeprefix("./")


def _base_of(repo_id: str, commit: str, files: dict[str, tuple[int, str | None]], folder: str) -> str:
    """The base location FOLDER's delta names: its header read from this host's copy (this commit's, or its blob
    kept by an earlier commit's download), else by range at COMMIT, one request for most headers
    (`first_header_read`)."""
    from huggingface_hub import hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.utils import build_hf_headers  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    path = f"{folder}/{DELTA_FILE}"
    where = f"{SCHEME}{repo_id}/{path}"
    size, blob = files[path]
    cache = repo_cache_folder(repo_id)
    # The file at this commit (an earlier open of it), else its blob (an earlier commit's, by its LFS sha256).
    kept = next((p for p in (cache / "snapshots" / commit / path, cache / "blobs" / (blob or "-"))
                 if p.is_file() and p.stat().st_size == size), None)
    try:
        if kept is not None:
            header, _ = read_shard_header(kept, DELTA_FILE)
        else:
            url, headers = hf_hub_url(repo_id, path, revision=commit), build_hf_headers()
            header, _ = read_header_by_range(
                lambda start, end: read_hub_range(url, headers, start, end - start, where), DELTA_FILE, where,
                first_header_read(size))
        return base_location_of(header, where)
    except Exception:  # noqa: BLE001 - the delta's own reading names what is wrong with it, as it always has
        return read_delta(_fetched(repo_id, commit, [folder]) / folder).base_location


def _files_at(repo_id: str, commit: str) -> dict[str, tuple[int, str | None]]:
    """The files of REPO_ID at COMMIT: path -> (size, the name of its blob in the Hub cache: an LFS file's sha256;
    None where not known). From huggingface_hub's own copy of the list when an earlier download at COMMIT kept one
    (`get_cached_repo_tree`, huggingface_hub 2.x: without the LFS sha256, but this commit's files are then in
    its snapshot folder), else listed (one request)."""
    import huggingface_hub  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    try:
        entries = huggingface_hub.get_cached_repo_tree(repo_id, revision=commit)
    except Exception:  # noqa: BLE001 - none kept (or a huggingface_hub without it): list the commit's files
        try:
            entries = huggingface_hub.HfApi().list_repo_tree(repo_id, revision=commit, recursive=True)
            entries = list(entries)
        except Exception as exc:
            raise hub_error(exc, repo_id, commit) from exc
    return {f.path: (int(f.size), f.lfs.sha256 if getattr(f, "lfs", None) else None)
            for f in entries if getattr(f, "size", None) is not None}


def _fetched(repo_id: str, commit: str, folders: list[str]) -> Path:
    """The snapshot folder of COMMIT, FOLDERS' files in it: each fetched unless its blob is in the Hub cache, all
    at the same time (`snapshot_download`'s threads)."""
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    try:
        return Path(snapshot_download(repo_id, revision=commit, allow_patterns=[f"{f}/*" for f in folders]))
    except Exception as exc:
        raise hub_error(exc, repo_id, commit) from exc


def _blob_bytes(repo_id: str) -> int:
    """The bytes in the Hub cache's blobs of REPO_ID (what a fetch adds)."""
    blobs = repo_cache_folder(repo_id) / "blobs"
    return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else 0
