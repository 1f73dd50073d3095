"""A training run's steps in a Hub repo, a folder per step (`hf://org/run`): found by listing the repo at one commit.

The Hub counterpart of `steps/store.py`: a poll resolves the watched branch to its commit once (`pin_commit`),
lists the repo's files at that commit (one tree listing), and groups them into step folders (`step_*`, ... holding
an integer). A step is reloaded as `hf://org/run/<folder>` at that commit: a delta's chain is read at the same
commit (`delta.hub_run`), so a push during a reload changes nothing for it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from layerwise_cli.checkpoint.delta.hub_run import SCHEME
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.format.layout import natural_key
from layerwise_cli.checkpoint.hub.pin import hub_error, pin_commit
from layerwise_cli.checkpoint.steps.local import DEFAULT_PATTERNS, step_number
from layerwise_cli.errors import LayerwiseError

Objects = tuple[tuple[str, str, int], ...]  # (path under the step, blob id, size), sorted by path


def is_hub_run(root: str) -> bool:
    """True for `hf://org/name` (a Hub repo whose folders are steps) and `hf://org/name/folder`."""
    return root.startswith(SCHEME) and len(root[len(SCHEME):].strip("/").split("/")) >= 2


@dataclass(frozen=True)
class HubRunStep:
    """One step folder of a Hub run, as one listing at one commit saw it.

    Attributes:
        name: the folder (also the servers' weight version).
        number: its step number (the last integer in the name).
        url: `hf://org/run/<name>`: what every target reloads.
        objects: the folder's files at the commit: (path under the step, blob id, size), sorted.
        commit: the commit the listing read: every target reads the step (and its chain) there.
    """

    name: str
    number: int
    url: str
    objects: Objects
    commit: str

    @property
    def source(self) -> str:
        return self.url

    @property
    def revision(self) -> str:
        return self.commit

    def names(self) -> list[str]:
        return [path for path, _, _ in self.objects]

    def signature(self) -> Objects:
        """What changes whenever a file of the step does (a new commit that leaves the folder as it was does
        not)."""
        return self.objects

    def examine(self) -> tuple[str | None, HubRunStep | None]:
        """Why the step is not (yet) a complete checkpoint at its commit, or None and the step: opened as a reload
        opens it (a delta through its chain, from this host's Hub cache)."""
        try:
            open_step(self.url, self.commit)
        except LayerwiseError as exc:
            return exc.what, None
        return None, self

    def excuse(self) -> tuple[str | None, bool]:
        """A failed reload of a commit's folder is its own (the commit does not move)."""
        return None, False

    def deletion_refusal(self, marker: str) -> str | None:
        return "watch --keep does not delete a Hub repo's folders"


def list_hub_run_steps(root: str, revision: str | None, patterns: Iterable[str] = DEFAULT_PATTERNS
                       ) -> list[HubRunStep]:
    """The step folders of the Hub run ROOT (`hf://org/run`) at REVISION's commit now, oldest first.

    Raises:
        LayerwiseError: one line naming the repo: not found, the revision not found, the Hub not reachable.
    """
    from huggingface_hub import HfApi  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    repo_id = "/".join(root[len(SCHEME):].strip("/").split("/")[:2])
    commit = pin_commit(repo_id, revision).commit
    try:
        files = [f for f in HfApi().list_repo_tree(repo_id, revision=commit, recursive=True)
                 if getattr(f, "size", None) is not None and hasattr(f, "blob_id")]
    except Exception as exc:
        raise hub_error(exc, repo_id, commit) from exc
    patterns = tuple(patterns)
    grouped: dict[str, list[tuple[str, str, int]]] = {}
    for f in files:
        folder, sep, rest = f.path.partition("/")
        if sep and rest and any(fnmatch.fnmatchcase(folder, p) for p in patterns):
            grouped.setdefault(folder, []).append((rest, f.blob_id, int(f.size)))
    steps = [HubRunStep(name, number, f"{SCHEME}{repo_id}/{name}", tuple(sorted(objects)), commit)
             for name, objects in grouped.items() if (number := step_number(name)) is not None]
    return sorted(steps, key=lambda s: (s.number, natural_key(s.name)))
