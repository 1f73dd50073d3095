"""Memory a reload raises: peak RSS of the benchmark and its engine processes (/proc), peak allocated on a GPU.

`MemoryWatch.engine_peak_delta` is what the table calls the engine's RSS rise
per call: before each timed call every process's peak RSS (VmHWM) is reset to
its current RSS (`/proc/PID/clear_refs`, 5), and after it the largest rise of
an engine process's peak over its RSS at the reset is taken. That is the host
memory a user sees a reload take (page-cache pages a process maps count while
mapped). `peak_rss` in the JSON is something else: each process's highest RSS
over the whole run (engine start-up included). On a GPU, `DeviceMemory` gives
the rise of the worker's peak allocated device memory over what was allocated
at the reset (torch's caching allocator: tensors, not its reserved pool).
"""

from __future__ import annotations


class MemoryWatch:
    """Peak RSS (VmHWM) of this process and every engine process, with resets to attribute peaks to a call."""

    def __init__(self) -> None:
        import psutil  # noqa: PLC0415 - psutil: optional dependency (a dev tool)

        self._psutil = psutil
        self.me = psutil.Process()
        self.overall: dict[int, int] = {}

    def processes(self) -> list:
        return [self.me, *self.me.children(recursive=True)]

    @staticmethod
    def _status(pid: int) -> dict[str, int]:
        values = {}
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        values[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        return values

    def snapshot(self) -> dict[int, dict[str, int]]:
        snap = {p.pid: self._status(p.pid) for p in self.processes()}
        for pid, values in snap.items():
            self.overall[pid] = max(self.overall.get(pid, 0), values.get("VmHWM", 0))
        return snap

    def reset(self) -> dict[int, dict[str, int]]:
        """Record peaks so far, then reset every process's VmHWM to its current RSS."""
        before = self.snapshot()
        for pid in before:
            try:
                with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
                    f.write("5")
            except OSError:
                pass
        return before

    def engine_peak_delta(self, before: dict[int, dict[str, int]]) -> int:
        """The largest rise of an engine process's peak RSS over its RSS at the reset."""
        after = self.snapshot()
        deltas = [after[pid].get("VmHWM", 0) - before[pid].get("VmRSS", 0)
                  for pid in after if pid != self.me.pid and pid in before]
        return max(deltas, default=0)

    def summary(self) -> dict:
        self.snapshot()
        bench = self.overall.get(self.me.pid, 0)
        engine = {pid: peak for pid, peak in self.overall.items() if pid != self.me.pid}
        return {"bench_bytes": bench, "engine_bytes": max(engine.values(), default=0),
                "total_bytes": bench + sum(engine.values()), "processes": len(self.overall)}


class DeviceMemory:
    """Peak allocated device memory of the engine's worker, per call (None on CPU)."""

    def __init__(self, llm, rpc) -> None:
        self.llm = llm
        self.rpc = rpc
        self.allocated: int | None = None

    def reset(self) -> None:
        self.allocated = self.rpc(self.llm, "layerwise_bench_memory_mark")["allocated"]

    def rise(self) -> int | None:
        """Peak allocated since `reset`, over what was allocated then."""
        if self.allocated is None:
            return None
        return self.rpc(self.llm, "layerwise_bench_memory_peak")["peak_allocated"] - self.allocated
