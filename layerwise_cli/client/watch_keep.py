"""`watch --keep N`: delete a local root's old step directories once every server holds the newest."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from layerwise_cli.checkpoint.steps import StepDir, deletion_refusal, list_steps, steps_to_delete
from layerwise_cli.client import watch_events as ev
from layerwise_cli.client.watch_options import WatchOptions
from layerwise_cli.client.watch_state import ServerState


def delete_old_steps(root: Path, options: WatchOptions, target, servers: list[ServerState]) -> Iterator[
        tuple[str, dict]]:
    """Delete what `--keep` allows now, yielding one event (kind, fields) per deletion or failed deletion.

    Nothing happens without `options.keep`, without a target (a `StepDir`), while a server loads a step, or
    until every server that is up holds TARGET. Never deleted: a step a server holds (a down server's last one
    included), a step newer than TARGET or among the newest `keep`, and anything this watch would not load
    (`deletion_refusal`: not a complete step, a symbolic link); those are left alone without an event.
    """
    keep = options.keep
    if keep is None or not isinstance(target, StepDir):
        return
    if any(s.busy and s.busy != "probe" for s in servers):
        return
    if not all(s.version == target.name and not s.dirty for s in servers if s.up):
        return
    protected = {s.last_version for s in servers if s.last_version} | {s.version for s in servers if s.version}
    for step in steps_to_delete(list_steps(root, options.patterns), keep, target, protected):
        if deletion_refusal(step, options.marker) is not None:
            continue  # not a step this watch would load: left alone, and nothing happened to report
        try:
            shutil.rmtree(step.path)
        except OSError as exc:
            yield ev.STEP_SKIPPED, {"step": step.name,
                                    "message": f"--keep {keep} could not delete it ({exc.strerror or exc})"}
            continue
        yield ev.STEP_DELETED, {"step": step.name, "by": "watch", "message": f"--keep {keep}"}
