"""One device_check run: its deadline, the machine it ran on, and the report it writes after every phase."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import safetensors
import torch

from benchmarks.device_report import render_table


def log(message: str) -> None:
    print(f"device_check: {message}", file=sys.stderr, flush=True)


def machine_info(device: torch.device) -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    info = {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "safetensors": safetensors.__version__, "cpus": cpus,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "root": os.geteuid() == 0, "torch_threads": torch.get_num_threads(), "device": str(device),
            "device_name": "cpu", "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory_bytes=props.total_memory)
    return info


class Budget:
    """The run's deadline, and what each phase is expected to take."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.deadline = self.start + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds


class Run:
    """One device_check run: the report it builds, written out after every phase."""

    def __init__(self, args, device: torch.device, out: Path, workdir: Path) -> None:
        self.args = args
        self.device = device
        self.out = out
        self.workdir = workdir
        self.budget = Budget(args.time_budget)
        self.report: dict = {
            "tool": "device_check", "version": 1, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine_info(device), "args": {k: v for k, v in vars(args).items()},
            "layouts": [], "writer": None, "targets": [], "skipped": [], "ok": False,
        }

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.report["elapsed_s"] = time.perf_counter() - self.budget.start
        (self.out / "device_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "device_check.txt").write_text(render_table(self.report) + "\n")

    def skip(self, what: str) -> None:
        log(f"NOT RUN: {what}")
        self.report["skipped"].append(what)

