"""The device check's writer check: save_checkpoint from tensors on the device and from CPU copies, same files?"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.device_run import Run, log
from benchmarks.device_variants import Setup
from layerwise_cli.checkpoint.format.digests import header_digests
from layerwise_cli.checkpoint.format.header import read_shard_header
from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.worker.stream.read_ahead import read_in_order
from layerwise_cli.writer.save import save_checkpoint


def writer_check(run: Run, setup: Setup) -> None:
    """save_checkpoint from the tensors read into the device, and from CPU copies of them: the same files?"""
    want = int(run.args.writer_gib * 2**30)
    parents: list[str | None] = []
    chosen, nbytes = [], 0
    for item in setup.layer_order:
        if item.parent not in parents:
            if nbytes >= want:
                break
            parents.append(item.parent)
        chosen.append(item)
        nbytes += item.entry.nbytes
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 5 * nbytes \
        else run.workdir
    root = Path(tempfile.mkdtemp(prefix="layerwise-device-writer-", dir=base))
    config = open_checkpoint(str(setup.folder)).config
    shard_size = max(1, nbytes // 3)
    writer: dict = {"ran": False, "device": str(setup.device), "tensors": len(chosen), "bytes": nbytes,
                    "layers": len(parents), "where": str(base)}
    run.report["writer"] = writer
    try:
        on_device = [(item.entry.name, tensor) for item, tensor in read_in_order(chosen, setup.folder,
                                                                                 device=setup.device)]
        if setup.cuda:
            torch.cuda.synchronize(setup.device)
        on_cpu = [(name, tensor.to("cpu").clone()) for name, tensor in on_device]
        start = time.perf_counter()
        save_checkpoint(iter(on_device), root / "device", config=config, max_shard_size=shard_size)
        writer["device_s"] = time.perf_counter() - start
        del on_device
        start = time.perf_counter()
        save_checkpoint(iter(on_cpu), root / "cpu", config=config, max_shard_size=shard_size)
        writer["cpu_s"] = time.perf_counter() - start
        del on_cpu
        files = sorted(p.name for p in (root / "cpu").iterdir())
        device_files = sorted(p.name for p in (root / "device").iterdir())
        differences = [] if files == device_files else [f"file lists differ: {device_files} vs {files}"]
        for name in files:
            if name in device_files and not same_bytes(root / "device" / name, root / "cpu" / name):
                differences.append(name)
        written = {}
        for name in device_files:
            if name.endswith(".safetensors"):
                written.update(header_digests(read_shard_header(root / "device" / name)[0]) or {})
        writer.update(ran=True, files=files, identical=not differences, differences=differences,
                      digests_match_source=bool(written) and all(setup.digests.get(n) == d for n, d in written.items())
                      and len(written) == len(chosen))
        log(f"writer: {len(files)} files, {'byte-identical' if not differences else 'DIFFERENT'}")
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, and fails the run
        writer.update(ran=False, reason=f"{type(exc).__name__}: {exc}")
        log(f"writer check failed: {writer['reason']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(8 << 20), fb.read(8 << 20)
            if x != y:
                return False
            if not x:
                return True

