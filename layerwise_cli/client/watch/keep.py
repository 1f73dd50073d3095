"""`watch --keep N`: delete a root's old steps (local directories, or step folders under a URL prefix) once every
server holds the newest."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

from layerwise_cli.checkpoint.steps.local import StepDir, deletion_refusal, steps_to_delete
from layerwise_cli.checkpoint.steps.store import StoreStep, delete_step
from layerwise_cli.client.watch import events as ev
from layerwise_cli.client.watch.options import WatchOptions
from layerwise_cli.client.watch.state import ServerState
from layerwise_cli.errors import LayerwiseError


class OldSteps:
    """`--keep`'s deletions over one watch (`delete_old_steps`): a store that refused a deletion is not asked again.

    Args:
        list_now: lists the root's steps afresh.
        options: the watch's options (`keep`, `marker`).
    """

    def __init__(self, list_now: Callable[[], list], options: WatchOptions) -> None:
        self.list_now, self.options = list_now, options
        self.refused = False  # a store refused a deletion: said once, never asked again

    def delete(self, target, servers: list[ServerState]) -> Iterator[tuple[str, dict]]:
        """What `--keep` allows now, as events (kind, fields); nothing once a store refused."""
        if self.refused:
            return
        for kind, fields in delete_old_steps(self.list_now, self.options, target, servers):
            self.refused = self.refused or (kind != ev.STEP_DELETED and isinstance(target, StoreStep))
            yield kind, fields


def delete_old_steps(list_now: Callable[[], list], options: WatchOptions, target,
                     servers: list[ServerState]) -> Iterator[tuple[str, dict]]:
    """Delete what `--keep` allows now, yielding one event (kind, fields) per deletion or failed deletion.

    Nothing happens without `options.keep`, without a target (a `StepDir` or a `StoreStep`), while a server loads
    a step, or until every server that is up holds TARGET. LIST_NOW lists the root's steps afresh. Never deleted:
    a step a server holds (a down server's last one included), a step newer than TARGET or among the newest
    `keep`, and anything this watch would not load (`deletion_refusal`: not a complete step, a symbolic link);
    those are left alone without an event. A store step's objects are deleted by one bulk request; a store that
    refuses (no delete permission) ends the deletions with one `step_skipped` event saying so.
    """
    keep = options.keep
    if keep is None or not isinstance(target, StepDir | StoreStep):
        return
    if any(s.busy and s.busy != "probe" for s in servers):
        return
    if not all(s.version == target.name and not s.dirty for s in servers if s.up):
        return
    protected = {s.last_version for s in servers if s.last_version} | {s.version for s in servers if s.version}
    try:
        steps = list_now()
    except LayerwiseError:
        return  # the root cannot be listed now: the next poll says so (a URL's as source_down)
    for step in steps_to_delete(steps, keep, target, protected):
        if _refusal(step, options.marker) is not None:
            continue  # not a step this watch would load: left alone, and nothing happened to report
        try:
            _delete(step)
        except (OSError, LayerwiseError) as exc:
            why = exc.what if isinstance(exc, LayerwiseError) else exc.strerror or exc
            yield ev.STEP_SKIPPED, {"step": step.name, "message": f"--keep {keep} could not delete it ({why})"}
            if isinstance(step, StoreStep):
                return  # the store refused: said once, nothing more is tried
            continue
        yield ev.STEP_DELETED, {"step": step.name, "by": "watch", "message": f"--keep {keep}"}


def _refusal(step: StepDir | StoreStep, marker: str) -> str | None:
    """Why STEP must stay (a local directory's `deletion_refusal`, a store step's own), or None."""
    return step.deletion_refusal(marker) if isinstance(step, StoreStep) else deletion_refusal(step, marker)


def _delete(step: StepDir | StoreStep) -> None:
    if isinstance(step, StoreStep):
        delete_step(step)
    else:
        shutil.rmtree(step.path)
