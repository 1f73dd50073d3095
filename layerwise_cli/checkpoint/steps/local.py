"""A training run's step directories: which exist, which are complete, which may be deleted."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.checkpoint.delta.read import delta_file, read_delta
from layerwise_cli.checkpoint.delta.source import MAX_CHAIN, base_directory
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.format.layout import INDEX_NAME, natural_key
from layerwise_cli.errors import LayerwiseError, describe_exception

# The names trainers give their step directories (prime-rl, verl, Hugging Face Trainer, Megatron).
DEFAULT_PATTERNS = ("step_*", "step-*", "global_step_*", "checkpoint-*", "iter_*")
AUTO = "auto"

COMPLETE = "complete"
SETTLING = "settling"  # the files are complete, but something changed less than `settle` seconds ago
INCOMPLETE = "incomplete"

_LAST_INTEGER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class StepDir:
    """One step directory under the run's root."""

    name: str
    path: Path
    number: int

    @property
    def source(self) -> str:
        """What a target reloads: the step directory's path."""
        return str(self.path)

    @property
    def revision(self) -> None:
        """A folder step has no commit (a Hub step's `revision` is its commit)."""
        return None

    def excuse(self) -> tuple[str | None, bool]:
        """Why a failed reload of this step is not its fault (None: it may be; here: it was deleted meanwhile),
        and whether it is gone for good (False: a deleted step vanishes from the listing by itself)."""
        return (None, False) if self.path.exists() else ("the step was deleted while it was loading", False)

    def names(self) -> list[str]:
        """The names in the step directory (a marker is one of them), listed afresh (NFS-friendly)."""
        return os.listdir(self.path)

    def signature(self) -> tuple:
        """What changes whenever a file under the step does (`tree_signature`)."""
        return tree_signature(self.path)

    def examine(self) -> tuple[str | None, StepDir | None]:
        """Why the step's files are not (yet) a complete checkpoint (`files_problem`), or None and the step."""
        problem = files_problem(self.path)
        return problem, (self if problem is None else None)


@dataclass(frozen=True)
class Completeness:
    """Whether a step may be loaded, and why (not)."""

    state: str  # COMPLETE, SETTLING or INCOMPLETE
    reason: str
    # What to load when COMPLETE: the step itself, or a store step pinned at the objects its check read
    # (`steps.store.StoreStep.examine`); None for a store step whose marker is there but whose check failed (its
    # reload reads, and fails on, what is there).
    loadable: object | None = None

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


def step_number(name: str) -> int | None:
    """The step number of a directory name: its last integer (`global_step_120` -> 120), None if it has none."""
    match = _LAST_INTEGER.search(name)
    return int(match.group(1)) if match else None


def list_steps(root: str | os.PathLike[str], patterns: Iterable[str] = DEFAULT_PATTERNS) -> list[StepDir]:
    """List ROOT afresh (no cached listing: NFS-friendly) and return its step directories, oldest first.

    Args:
        root: the directory holding one directory per step.
        patterns: shell globs a step directory's name must match; names without an integer are ignored.

    Returns:
        The step directories, sorted by step number (then name).

    Raises:
        LayerwiseError: ROOT does not exist or cannot be read.
    """
    root = Path(root)
    patterns = tuple(patterns)
    found = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if not any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
                    continue
                number = step_number(entry.name)
                if number is None or not entry.is_dir():
                    continue
                found.append(StepDir(entry.name, Path(entry.path), number))
    except OSError as exc:
        raise describe_exception(exc, where=str(root)) from exc
    return sorted(found, key=lambda s: (s.number, natural_key(s.name)))


def files_problem(path: Path) -> str | None:
    """Why the step's safetensors files are not (yet) complete, or None when they are.

    Complete: a valid index whose every shard exists with a valid header, each
    file exactly as long as its header says and holding the tensors the index
    names; or, without an index, a single shard that is valid the same way.
    Only headers are read.
    """
    try:
        names = os.listdir(path)
    except OSError as exc:
        return f"cannot list it ({exc.strerror or exc})"
    if INDEX_NAME in names:
        try:
            index = json.loads((path / INDEX_NAME).read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                return f"{INDEX_NAME} has no weight_map"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{INDEX_NAME} is not valid yet ({type(exc).__name__})"
        shards = sorted(set(map(str, weight_map.values())), key=natural_key)
    else:
        shards = [n for n in names if n.endswith(".safetensors")]
        if not shards:
            return "no .safetensors file yet"
        if len(shards) > 1:
            return f"{len(shards)} shards and no {INDEX_NAME}"
    present: set[tuple[str, str]] = set()
    for shard in shards:
        if "/" in shard or shard not in names:
            return f"shard {shard} does not exist yet"
        try:
            header, _ = read_shard_header(path / shard, shard)
        except LayerwiseError as exc:
            return f"shard {shard}: {exc.what}"
        present.update((t.name, shard) for t in header.tensors)
    if INDEX_NAME in names:
        for tensor, shard in weight_map.items():
            if (tensor, shard) not in present:
                return f"shard {shard} has no tensor {tensor} (the index names it)"
    return None


def tree_signature(path: Path) -> tuple:
    """Name, size and modification time of everything under PATH: it changes whenever a file does."""
    items = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files) + dirs:
            full = os.path.join(folder, name)
            try:
                st = os.stat(full)
            except OSError:
                continue  # deleted while we looked: the next poll sees it
            items.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return tuple(items)


class CompletenessTracker:
    """Decide, poll after poll, whether each step is complete.

    A step is a local directory (`StepDir`) or a step under a URL prefix (`steps.store.StoreStep`); each lists
    its names, gives a signature that changes with any of its files, and examines its files (headers only).
    With a marker, a step is complete once the marker is among its names (a directory is listed afresh, which
    NFS does not answer from a cache of negative lookups); a store step is then examined once per signature, to
    pin it. With `auto`, once its examination finds nothing and its signature did not change for `settle`
    seconds.
    """

    def __init__(self, marker: str = AUTO, settle: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.marker = marker
        self.settle = settle
        self._clock = clock
        # step name -> (signature, when it was first seen, its examination for that signature)
        self._seen: dict[str, tuple[tuple, float, tuple[str | None, object | None]]] = {}

    def check(self, step) -> Completeness:
        """Where STEP stands now."""
        if self.marker != AUTO:
            try:
                present = self.marker in step.names()
            except OSError as exc:
                return Completeness(INCOMPLETE, f"cannot list it ({exc.strerror or exc})")
            if not present:
                return Completeness(INCOMPLETE, f"no {self.marker} marker yet")
            if isinstance(step, StepDir):
                return Completeness(COMPLETE, f"marker {self.marker} present", step)
            problem, loadable = self._examined(step)[2]
            return Completeness(COMPLETE, f"marker {self.marker} present{'; ' + problem if problem else ''}",
                                loadable)
        now = self._clock()
        _, since, (problem, loadable) = self._examined(step)
        if problem is not None:
            return Completeness(INCOMPLETE, problem)
        quiet = now - since
        if quiet < self.settle:
            return Completeness(SETTLING, f"changed {quiet:.1f} s ago (settle {self.settle:g} s)")
        return Completeness(COMPLETE, f"files complete, unchanged for {self.settle:g} s", loadable)

    def _examined(self, step) -> tuple[tuple, float, tuple[str | None, object | None]]:
        """STEP's signature, since when it is unchanged, and its examination: examined again when it changed."""
        signature = step.signature()
        previous = self._seen.get(step.name)
        if previous is None or previous[0] != signature:
            previous = (signature, self._clock(), step.examine())
            self._seen[step.name] = previous
        return previous

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is remembered about steps no longer listed."""
        keep = set(keep)
        for name in list(self._seen):
            if name not in keep:
                del self._seen[name]


def deletion_refusal(step: StepDir, marker: str = AUTO) -> str | None:
    """Why `--keep` must leave STEP where it is, or None when it may delete it.

    Only a step this watch would load may go: a real directory (a symbolic
    link is never followed: its target is not the run's), complete by the
    marker or by its files (a valid index naming shards that are all there, or
    one valid shard). A directory that only matches the pattern (`step_0`
    holding notes) is not a step.
    """
    if step.path.is_symlink():
        return "a symbolic link: its target is not the run's to delete"
    if not step.path.is_dir():
        return "not a directory"
    if marker != AUTO:
        try:
            if marker in os.listdir(step.path):
                return None
        except OSError as exc:
            return f"cannot list it ({exc.strerror or exc})"
    problem = files_problem(step.path)
    return None if problem is None else f"not a complete checkpoint: {problem}"


def steps_to_delete(steps: list, keep: int, held, protected: Iterable[str]) -> list:
    """The steps `--keep N` removes once every server holds HELD.

    Only steps older than HELD and outside the newest KEEP steps go, never one
    named in PROTECTED (held or being loaded by a server), nor the base of a
    sparse delta step that stays (a delta is rebuilt from its base's files, and
    a base that is a delta from its own). STEPS come from `list_steps` (or
    `steps.store.list_store_steps`), so nothing that does not match the
    pattern is ever touched.
    """
    if keep < 1:
        raise LayerwiseError(f"--keep must be at least 1, not {keep}")
    protected = set(protected) | {held.name}
    newest = {s.name for s in sorted(steps, key=lambda s: s.number)[-keep:]}
    gone = [s for s in steps if s.number < held.number and s.name not in newest and s.name not in protected]
    # Deltas are read from local directories only: a store step is never a delta's base.
    needed = delta_bases([s.path for s in steps if s not in gone and isinstance(s, StepDir)])
    return [s for s in gone if not isinstance(s, StepDir) or s.path.absolute() not in needed]


def delta_bases(paths: Iterable[Path]) -> set[Path]:
    """The base directories (absolute) the sparse deltas among PATHS are rebuilt from, their chains followed."""
    needed: set[Path] = set()
    for path in paths:
        for _ in range(MAX_CHAIN):
            try:
                if delta_file(path) is None:
                    break
                path = base_directory(read_delta(path)).absolute()
            except LayerwiseError:
                break  # a broken delta: what it would need is unknown, and kept or not, it cannot load
            needed.add(path)
    return needed
