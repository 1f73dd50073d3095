"""Where the loop's trainer writes its steps: a local run folder (deltas), a SeaweedFS bucket or the loopback Hub.

Each step is a delta against the one before (`save_checkpoint(..., base=previous)`; the first in full), in a
local run folder; the bucket and the Hub get the trainer's local copy of the run uploaded a step at a time (a
step folder each, a delta's base the folder beside it).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from layerwise_cli import save_checkpoint
from tests.support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY

MARKER = "STABLE"
RUN = "run"
HUB_REPO = "rl/run"


@dataclass(frozen=True)
class Published:
    """One step the trainer wrote.

    Attributes:
        step: its number.
        name: its name as `watch` reports it (the step folder's name, or the Hub commit).
        saved_at: wall-clock time the trainer's save (and upload) returned.
        save_s: how long the save (and upload) took.
        written_bytes: tensor bytes written or uploaded (the delta's, for a delta).
        full_bytes: the full step's tensor bytes.
        kind: `delta` or `full`.
        nan: the step holds a NaN (the loop's NaN fault).
    """

    step: int
    name: str
    saved_at: float
    save_s: float
    written_bytes: int
    full_bytes: int
    kind: str
    nan: bool = False


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _stalled(tensors: dict[str, torch.Tensor], ready):
    """The tensors, then a stall halfway (a trainer gathering its shards); READY is set at the stall."""
    items = list(tensors.items())
    yield from items[: len(items) // 2]
    ready.set()
    time.sleep(3600)
    yield from items[len(items) // 2:]


def killed_midway(write, tensors, start: str = "fork") -> None:
    """Run WRITE(tensors, ready) in a child process and SIGKILL it once it says it is halfway (READY set).

    START: how the child starts (`spawn` for a WRITE that uses a library whose threads a fork loses, such as
    obstore's runtime; then WRITE and TENSORS must pickle)."""
    context = multiprocessing.get_context(start)
    ready = context.Event()
    child = context.Process(target=write, args=(tensors, ready), daemon=True)
    child.start()
    if not ready.wait(timeout=300):
        child.kill()
        raise RuntimeError("the trainer's save did not reach its halfway point in 300 s")
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=60)


class RunFolder:
    """The trainer's own copy of its run: step N in `ROOT/step_N`, each a delta against the step saved before it
    (the first in full), as a trainer calls `save_checkpoint(..., base=previous)`. Every store keeps one."""

    def __init__(self, root: Path, config: dict, marker: str | None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.marker = marker
        self.previous: Path | None = None

    def write(self, step: int, tensors: dict[str, torch.Tensor], *, nan: bool = False):
        """Write STEP against the last saved step (over a copy a killed upload left); the next base is unchanged."""
        return save_checkpoint(tensors.items(), self.root / f"step_{step}", config=self.config, marker=self.marker,
                               base=self.previous, allow_nonfinite=nan, overwrite=True)

    def save(self, step: int, tensors: dict[str, torch.Tensor], *, nan: bool = False):
        """Write STEP, and make it the next step's base."""
        saved = self.write(step, tensors, nan=nan)
        self.previous = saved.directory
        return saved


def published(step: int, name: str, started: float, sent: int, tensors: dict[str, torch.Tensor], saved,
              nan: bool) -> Published:
    """What the trainer's save of STEP (SAVED, started at monotonic STARTED, SENT bytes) published as NAME."""
    return Published(step, name, time.time(), time.monotonic() - started, sent, tensor_bytes(tensors),
                     "delta" if saved.delta is not None else "full", nan)


class LocalSteps:
    """Steps in a local run folder, each a delta against the step written before it (the first one full)."""

    kind = "local"

    def __init__(self, root: Path, config: dict) -> None:
        self.folder = RunFolder(root / RUN, config, MARKER)
        self.run = self.folder.root
        self.config = config
        self.env: dict[str, str] = {}
        self.names = Names()
        self.step_of = self.names.step_of

    @property
    def watch_root(self) -> str:
        return str(self.run)

    def publish(self, step: int, tensors: dict[str, torch.Tensor], *, nan: bool = False) -> Published:
        started = time.monotonic()
        saved = self.folder.save(step, tensors, nan=nan)
        self.names.steps[saved.directory.name] = step
        return published(step, saved.directory.name, started, saved.total_bytes, tensors, saved, nan)

    def source_of(self, pub: Published) -> tuple[str, str | None]:
        """Where a reader finds step PUB, and at which revision (None: no revision)."""
        return str(self.run / pub.name), None

    def publish_killed(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """The trainer killed halfway through writing STEP: what it leaves behind is never a step."""
        base = self.folder.previous

        def write(tensors, ready):
            save_checkpoint(_stalled(tensors, ready), self.run / f"step_{step}", config=self.config, marker=MARKER,
                            base=base)

        killed_midway(write, tensors)

    def outage(self, seconds: float) -> bool:
        """A local folder has no outage to simulate: False."""
        return False



# The weight version vLLM gives an engine before any update: the weights the servers started on, step 0's.
START_VERSION = "default"


class Names:
    """Weight version -> step number, for the steps this store published (vLLM's `default` -> 0)."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def step_of(self, version: str | None) -> int | None:
        """The step VERSION names; 0 for the weights the servers started on; None: not a step of this run."""
        if version in (None, START_VERSION):
            return 0
        return self.steps.get(version)


class BucketSteps:
    """Steps uploaded to a SeaweedFS bucket under `run/step_N/`, the marker last: each a delta against the step
    uploaded before it (the first one full), written first to the trainer's local copy of the run (SCRATCH/run,
    where the next delta finds its base), then uploaded; a reader finds a delta's base beside it in the bucket."""

    kind = "seaweedfs"

    def __init__(self, s3, scratch: Path, config: dict) -> None:
        self.s3 = s3
        self.folder = RunFolder(scratch / RUN, config, None)
        self.env = s3.env()
        self.names = Names()
        self.step_of = self.names.step_of

    @property
    def watch_root(self) -> str:
        return f"s3://{BUCKET}/{RUN}/"

    def publish(self, step: int, tensors: dict[str, torch.Tensor], *, nan: bool = False) -> Published:
        started = time.monotonic()
        saved = self.folder.save(step, tensors, nan=nan)
        sent = upload_step(self.s3.endpoint, f"{RUN}/step_{step}", saved.directory)
        self.names.steps[f"step_{step}"] = step
        return published(step, f"step_{step}", started, sent, tensors, saved, nan)

    def source_of(self, pub: Published) -> tuple[str, str | None]:
        return self.watch_root + pub.name, None

    def publish_killed(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """The trainer killed mid-upload: STEP's weight files are in the bucket, the rest and the marker are not."""
        folder = self.folder.write(step, tensors).directory
        killed_midway(_upload_then_stall, (self.s3.endpoint, f"{RUN}/step_{step}", folder), start="spawn")

    def outage(self, seconds: float) -> bool:
        """The store stopped for SECONDS, then started again (same data)."""
        self.s3.stop()
        time.sleep(seconds)
        self.s3.start()
        return True


def upload_step(endpoint: str, prefix: str, folder: Path, ready=None) -> int:
    """Put FOLDER's files under PREFIX in the test SeaweedFS at ENDPOINT: shards, then the rest, the marker last.

    READY: set once the shards are up, and the upload then stalls (where the loop's trainer is killed).
    Returns the shard bytes sent.
    """
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)
    from obstore.store import S3Store  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

    store = S3Store(BUCKET, prefix=prefix, endpoint=endpoint, access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY, region="us-east-1", client_options={"allow_http": True})
    sent = 0
    for path in sorted(folder.iterdir(), key=lambda p: (p.suffix != ".safetensors", p.name)):
        if ready is not None and path.suffix != ".safetensors":
            ready.set()  # the shards are up, the index is not: killed here
            time.sleep(3600)
        obstore.put(store, path.name, path.read_bytes())
        sent += path.stat().st_size if path.suffix == ".safetensors" else 0
    obstore.put(store, MARKER, b"")
    return sent


def _upload_then_stall(where: tuple[str, str, Path], ready) -> None:
    upload_step(*where, ready=ready)


class HubSteps:
    """Steps pushed to the loopback Hub as a run of step folders in `rl/run` (`hf://rl/run/step_N`), each push a
    commit of main holding every step so far (as `hf upload rl/run step_N step_N` after each step leaves them):
    each step a delta against the one before (the first one full), written first to the trainer's local copy of
    the run; a reader finds a delta's base folder beside it at the same commit."""

    kind = "hub"

    def __init__(self, hub, scratch: Path, config: dict) -> None:
        self.hub = hub
        self.scratch = scratch
        self.folder = RunFolder(scratch / RUN, config, MARKER)
        self.commits: dict[str, str] = {}  # step folder -> the commit that first held it
        self.names = Names()
        self.step_of = self.names.step_of
        hub.add_repo(HUB_REPO, self._snapshot())  # the run's repo, no step yet
        self.env = {"HF_ENDPOINT": hub.endpoint}

    @property
    def watch_root(self) -> str:
        return f"hf://{HUB_REPO}"

    def _snapshot(self) -> Path:
        """The run as pushed now, frozen: a commit's files never change (hard links; a step is never rewritten
        in place, `save_checkpoint` renames a finished folder)."""
        frozen = self.scratch / "commits" / f"{len(self.commits)}-{time.monotonic_ns()}"
        shutil.copytree(self.folder.root, frozen, copy_function=os.link)
        return frozen

    def publish(self, step: int, tensors: dict[str, torch.Tensor], *, nan: bool = False) -> Published:
        started = time.monotonic()
        saved = self.folder.save(step, tensors, nan=nan)
        name = saved.directory.name
        self.commits[name] = self.hub.move_ref(HUB_REPO, "main", self._snapshot())
        self.names.steps[name] = step
        return published(step, name, started, saved.total_bytes, tensors, saved, nan)

    def source_of(self, pub: Published) -> tuple[str, str | None]:
        return f"{self.watch_root}/{pub.name}", self.commits[pub.name]

    def publish_killed(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """The trainer killed before its push: the half-written folder never becomes a commit."""
        base, folder, config = self.folder.previous, self.scratch / f"killed_{step}", self.folder.config

        def write(tensors, ready):
            save_checkpoint(_stalled(tensors, ready), folder, config=config, marker=MARKER, base=base)

        killed_midway(write, tensors)

    def outage(self, seconds: float) -> bool:
        """Every Hub request answered 503 for SECONDS."""
        self.hub.outage = 503
        time.sleep(seconds)
        self.hub.outage = None
        return True
