"""A reload's plan on one worker, made before anything changes: SOURCE opened, planned for this rank, pre-flighted.

`stream_reload` runs it first; the `layerwise_preflight` RPC runs only it, so
that a fleet can check every server before it pauses any (`client/servers/fleet.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from layerwise_cli.checkpoint.delta.hub_run import is_hub_step
from layerwise_cli.checkpoint.delta.rebuilt_step import write_rebuilt_step
from layerwise_cli.checkpoint.delta.source import is_remote_step, open_step
from layerwise_cli.checkpoint.hub.pin import is_commit, repo_cache_folder
from layerwise_cli.checkpoint.local_pin import files_pin
from layerwise_cli.checkpoint.sources import Checkpoint, looks_like_repo_id, open_checkpoint, pin_source, resolve_local
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.reload.delta_base import OFF_CHAIN_NOTE
from layerwise_cli.worker.reload.preflight import preflight, reference_checkpoint, refuse_direct_mode
from layerwise_cli.worker.repairs.amx_mla import missing_message
from layerwise_cli.worker.state.plan_cache import plan_cache_of, structure_key
from layerwise_cli.worker.state.prepared import prepared_folder, prepared_of, step_files
from layerwise_cli.worker.stream.rank_plan import RankPosition, WorkerPlan, plan_for_worker, rank_position

_LOADED_FROM = "_layerwise_loaded_from"
# What a reload's report says when it took the step its pre-flight prepared (`prepare_for_reload`).
PREPARED_NOTE = "opened and checked by the pre-flight, while the engine served"
PREPARED_REBUILT_NOTE = ("rebuilt from its delta chain into a full step's files by the pre-flight, while the engine "
                         "served")


@dataclass
class PlannedReload:
    """What pre-flight found: SOURCE's folder (only a name for a URL), its headers, this rank's plan, notes."""

    folder: Path
    checkpoint: Checkpoint
    position: RankPosition
    mine: WorkerPlan
    notes: list[str]
    # The Hub commit SOURCE was read at (None for a local path): what this worker then holds.
    commit: str | None = None

    @property
    def streamed(self) -> bool:
        """True when SOURCE is a Hub commit not yet on this machine, or a URL: its tensors are fetched as read."""
        return self.checkpoint.kind in ("hub", "store") and self.checkpoint.local_dir is None


def plan_reload(worker, source: str, *, revision: str | None = None, allow_partial: bool = False,
                stream: bool = False) -> PlannedReload:
    """Open SOURCE, plan this rank's share of it and pre-flight it against the engine; change nothing.

    The same structure as last time (a trainer's next step) reuses last time's
    plan and pre-flight (`plan_cache`).

    A URL SOURCE (`s3://bucket/prefix`) is always streamed: its headers are read by range, and the reload
    fetches the tensors it hands over, each request naming the ETag read first (`store.StoreSource`).

    A Hub SOURCE is read at one commit (`hub_commit`). With STREAM, only its headers are read here (by range
    requests; nothing else is downloaded) unless the commit's shards are all in the Hub cache already: the
    reload then fetches exactly the tensors it hands over (`remote_stream`). Without, the commit's files are
    downloaded first.

    Raises:
        LayerwiseError: SOURCE cannot be read, or cannot be loaded cleanly into this engine.
    """
    refuse_direct_mode()
    model = worker.model_runner.get_model()
    model_config = worker.model_runner.model_config
    commit = hub_commit(source, revision)
    prepared_notes: tuple[str, ...] = ()
    if is_store_url(source):
        # Never downloaded whole: read by range, pinned to the objects' ETags (REVISION: the pin the client
        # read; objects changed since are refused). The folder is a name only; no file is opened in it. A
        # delta step is read from this host's store cache (`delta.remote`), its chain pinned as one.
        checkpoint, prepared_notes = opened_step(worker, source, revision)
        # A step the pre-flight rebuilt is read from its files here (`prepare_for_reload`).
        rebuilt = checkpoint.delta is None and checkpoint.local_dir is not None
        folder = checkpoint.local_dir if rebuilt else Path(display_url(source))
    elif is_hub_step(source):
        # A step folder of a Hub run (`hf://org/run/step_120`), at the commit the client pinned: its chain
        # from the Hub cache (`delta.hub_run`).
        checkpoint, prepared_notes = opened_step(worker, source, revision)
        folder = checkpoint.local_dir
    elif commit is not None and stream:
        checkpoint = hub_checkpoint(source, commit)
        folder = checkpoint.local_dir or snapshot_folder(source, commit)
    else:
        folder = resolve_local(source, commit or revision)
        # A local delta step the pre-flight prepared, its files unchanged since (`prepare_for_reload`).
        kept = prepared_of(worker).take_local(source) if commit is None else None
        if kept is not None:
            checkpoint, prepared_notes = kept
            if checkpoint.delta is None:  # rebuilt into a full step's files: read from there
                folder = checkpoint.local_dir
        else:
            checkpoint = replace(open_step(str(folder)), source=source)
    hf_config = model_config.hf_config.to_dict() if hasattr(model_config.hf_config, "to_dict") else None
    position = rank_position(worker)
    # Only the tensors this rank holds: its pipeline stage, its experts.
    cache = plan_cache_of(worker)
    key = structure_key(checkpoint, allow_partial)
    cached = cache.get(key)
    if cached is not None:
        mine, notes = cached
    else:
        mine = plan_for_worker(checkpoint, model, hf_config, position, reference_checkpoint(str(model_config.model)))
        notes = preflight(mine.plan, model, mine.vllm_names, mine.reference, allow_partial=allow_partial)
        cache.put(key, mine, notes)
    # Layers the engine keeps no copy of (vLLM's AMX MLA backend empties kv_b_proj.weight) must be in SOURCE.
    missing = missing_message(model, {item.parent for item in mine.engine_stream("layer") if item.parent})
    if missing is not None:
        raise LayerwiseError(f"{source}: {missing}")
    return PlannedReload(folder, checkpoint, position, mine, [*notes, *prepared_notes], commit)


def prepare_for_reload(worker, source: str, revision: str | None, planned: PlannedReload, rebuilds: bool,
                       check_finite: bool = True, began: float | None = None) -> None:
    """Keep SOURCE as this pre-flight opened and checked it, for the reload at the same pin (`state/prepared.py`).

    A step by URL or of a Hub run is kept at its pin REVISION. A local delta step is kept at its files' pin
    (`checkpoint/local_pin.py`), when none of them changed after BEGAN (a `time.time()` taken before the
    pre-flight read them); a local full step needs nothing prepared.

    A delta step the reload would rebuild (REBUILDS: some of its layers cannot be patched in place) is rebuilt
    here, once, into a full step's files on this host: the reload then reads those, inside a server's pause,
    and decodes nothing; with CHECK_FINITE, a NaN or Inf it rebuilds is refused here, before any pause. Only
    for an engine of one rank (each rank of a larger one would rebuild the whole step).

    Raises:
        LayerwiseError: the step does not rebuild, or holds NaN or Inf (CHECK_FINITE).
    """
    files: tuple[Path, ...] = ()
    if not is_remote_step(source):
        if planned.commit is not None or planned.checkpoint.delta is None or planned.checkpoint.local_dir is None:
            return
        files = tuple(step_files(planned.checkpoint))
        revision = files_pin(files, unchanged_since=began) if began is not None else None
    if not revision:
        return
    checkpoint, notes = planned.checkpoint, (PREPARED_NOTE,)
    position = planned.position
    if checkpoint.delta is not None and rebuilds and position.tp_size * position.pp_size == 1:
        checkpoint = write_rebuilt_step(checkpoint, prepared_folder(), check_finite=check_finite)
        # The rebuilt step is a full step: what the chain told about the engine is said here, once.
        notes = (*(note for note in planned.notes if note.startswith(OFF_CHAIN_NOTE)), PREPARED_REBUILT_NOTE)
    prepared_of(worker).keep(source, revision, checkpoint, notes, files)


def opened_step(worker, source: str, revision: str | None) -> tuple[Checkpoint, tuple[str, ...]]:
    """SOURCE (a URL, or a Hub run's step) at the pin REVISION, and the notes its preparation left: as the
    pre-flight before this reload opened and checked it (`state/prepared.py`), else opened now (`open_step`)."""
    return prepared_of(worker).take(source, revision) or (open_step(source, revision), ())


def hub_checkpoint(repo_id: str, commit: str) -> Checkpoint:
    """The headers of REPO_ID at COMMIT, read by range requests; its shards' folder set when all are cached.

    Offline, `open_checkpoint` reads the cache itself (and fails on a shard missing there).
    """
    checkpoint = replace(open_checkpoint(repo_id, commit), source=repo_id)
    if checkpoint.local_dir is None:
        folder = snapshot_folder(repo_id, commit)
        if all((folder / shard.name).is_file() for shard in checkpoint.shards):
            checkpoint = replace(checkpoint, local_dir=folder)
    return checkpoint


def snapshot_folder(repo_id: str, commit: str) -> Path:
    """Where the Hub cache keeps REPO_ID's files at COMMIT (`snapshots/<commit>/`), whether or not they are there."""
    return repo_cache_folder(repo_id) / "snapshots" / commit


def hub_commit(source: str, revision: str | None) -> str | None:
    """The commit to read a Hub SOURCE at: REVISION, which the client pinned (`pin_source`); None for a local path.

    A caller that sent a branch or tag (an older client, a direct RPC) has it resolved here, once for this
    rank, so that what the worker records as held is a commit all the same.
    """
    if not looks_like_repo_id(source):
        return None
    if is_commit(revision):
        return revision
    pin = pin_source(source, revision)
    return None if pin is None else pin.commit


def loaded_from(worker) -> tuple[str, str | None]:
    """(source, revision) of the weights this worker holds: its last completed reload, else the engine's model.

    For a Hub source the revision is the commit it was read at (`mark_loaded_from`), never a branch: a rollback
    or a fleet going back reloads exactly those weights, wherever the branch has moved since.
    """
    previous = getattr(worker, _LOADED_FROM, None)
    if previous is not None:
        return previous
    model_config = worker.model_runner.model_config
    return str(model_config.model), getattr(model_config, "revision", None)


def mark_loaded_from(worker, source: str, revision: str | None) -> None:
    """Record that WORKER now holds SOURCE (at REVISION, a commit for a Hub source): what a rollback, or a fleet
    going back, reloads."""
    setattr(worker, _LOADED_FROM, (source, revision))
