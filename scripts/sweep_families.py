"""Reload every text architecture of the architecture table into a real engine, and record how it went.

For each architecture of `layerwise_cli/planning/architectures.json`, and each
causal LM of the installed `transformers` outside it that vLLM serves on its
Transformers backend anyway (`sweep_build.fallback_architectures`: Dots1),
that `transformers` can build, a tiny random model (`scripts/sweep_build.py`), an
engine started fresh on checkpoint B, and one engine on A reloaded with
layerwise B, A, B and then with vLLM's own `reload_weights` of B
(`scripts/sweep_cell.py`); the outcomes and the docs section come from
`scripts/sweep_docs.py`. The cells run in a worker process that takes the
architectures one by one and is started again when it dies or exceeds the
per-architecture timeout, so that no crash or hang stops the sweep. Results
are written to docs/coverage-sweep.json after every architecture.

    python scripts/sweep_families.py                       # the whole table and the fallback architectures
    python scripts/sweep_families.py --only Qwen3ForCausalLM LlamaForCausalLM
    python scripts/sweep_families.py --resume              # skip the architectures already in the JSON
    python scripts/sweep_families.py --write-docs          # docs/coverage.md's section and README's sentence
                                                           # from the JSON (with no sweep: add --only NONE)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `scripts.*` and `tests.support.*`, however this file is run
    sys.path.insert(0, str(ROOT))

from scripts import sweep_docs  # noqa: E402
from scripts.sweep_build import fallback_architectures, transformers_class  # noqa: E402
from scripts.sweep_cell import worker_main  # noqa: E402

TABLE = ROOT / "layerwise_cli" / "planning" / "architectures.json"
RESULTS = ROOT / "docs" / "coverage-sweep.json"
COVERAGE = ROOT / "docs" / "coverage.md"
README = ROOT / "README.md"
WORK = Path("/tmp/layerwise-sweep")
TIMEOUT_S = 180.0


class Worker:
    """The worker process: architectures in on stdin, JSON messages out on a pipe, logs to a file."""

    def __init__(self, work: Path, number: int) -> None:
        self.log_path = work / "logs" / f"worker-{number}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, write_end = os.pipe()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--worker", "--channel-fd", str(write_end), "--work", str(work)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_end,),
                cwd=ROOT, text=True, start_new_session=True)
        os.close(write_end)
        self.channel = read_end
        self.pending = b""

    def send(self, arch: str) -> None:
        self.process.stdin.write(arch + "\n")
        self.process.stdin.flush()

    def messages(self, deadline: float):
        """The worker's messages until DEADLINE; ends with None on a timeout or "eof" when it died."""
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                yield json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0:
                yield None
                return
            ready, _, _ = select.select([self.channel], [], [], left)
            if ready:
                chunk = os.read(self.channel, 65536)
                if not chunk:
                    yield "eof"
                    return
                self.pending += chunk

    def last_error_line(self) -> str:
        """The last line of the worker's log that names an error (what killed it, usually)."""
        lines = self.log_path.read_text(errors="replace").splitlines()[-200:]
        errors = [line for line in lines if "Error" in line or "error" in line or "Killed" in line]
        return (errors or lines or [""])[-1].strip()[:300]

    def stop(self) -> None:
        """End the worker and everything it started (its own process group)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=20)
            except (subprocess.TimeoutExpired, OSError, BrokenPipeError):
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        os.close(self.channel)


def run_one(worker: Worker, arch: str, record: dict, timeout: float) -> bool:
    """Run ARCH's cell in WORKER, merging its parts into RECORD; False if the worker must be replaced."""
    worker.send(arch)
    deadline = time.monotonic() + timeout
    for message in worker.messages(deadline):
        if message is None or message == "eof":
            what = "timed out" if message is None else "worker died"
            if message is None:
                os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait()
            record["crash"] = {"what": what, "stage": record.get("stage"), "error": worker.last_error_line()}
            return False
        part, value = message["part"], message["value"]
        if part == "done":
            return not value["restart"]
        if part == "error":
            record["crash"] = {"what": "error", "stage": record.get("stage"), "error": value}
        else:
            record[part] = value
    return False


FALLBACK = sweep_docs.FALLBACK


def sweep_table() -> dict[str, dict]:
    """The architectures to sweep: the architecture table's, and those vLLM serves on its Transformers backend
    without a registry entry (`sweep_build.fallback_architectures`), with the backend each runs on."""
    table = {arch: {"backend": entry.get("backend", "vllm")}
             for arch, entry in json.loads(TABLE.read_text())["architectures"].items()}
    table.update({arch: {"backend": FALLBACK} for arch in fallback_architectures(table)})
    return table


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"architectures": {}}


def save_results(results: dict, path: Path) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    partial.replace(path)


def versions() -> dict:
    import transformers  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)
    import vllm  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    return {"vllm_version": vllm.__version__, "transformers_version": transformers.__version__,
            "date": datetime.date.today().isoformat()}


def sweep(architectures: list[str], table: dict, results: dict, path: Path, work: Path, timeout: float) -> None:
    """Run the cells of ARCHITECTURES, saving RESULTS to PATH after each one."""
    if not architectures:
        return
    for record in results["architectures"].values():  # each row keeps the date it was swept on
        record.setdefault("date", results.get("date"))
    results.update(versions())
    worker, started_workers = None, 0
    try:
        for number, arch in enumerate(architectures, start=1):
            found = transformers_class(arch)
            record = {"backend": table[arch]["backend"],
                      "transformers": None if found is None else f"{found[0].__name__} ({found[1].__name__})"}
            began = time.monotonic()
            if found is not None:
                if worker is None:
                    started_workers += 1
                    worker = Worker(work, started_workers)
                if not run_one(worker, arch, record, timeout):
                    worker.stop()
                    worker = None
            record["wall_s"] = round(time.monotonic() - began, 1)
            record["date"] = results["date"]
            results["architectures"][arch] = record
            save_results(results, path)
            layerwise, vllm = (sweep_docs.outcome_of(record, method)[0] for method in sweep_docs.METHODS)
            print(f"[{number}/{len(architectures)}] {arch}: layerwise {layerwise}, vLLM {vllm} "
                  f"({record['wall_s']} s)", flush=True)
    finally:
        if worker is not None:
            worker.stop()


def write_docs(results: dict) -> None:
    """docs/coverage.md's sweep section and README's sentence, from RESULTS."""
    archs = results["architectures"]
    COVERAGE.write_text(sweep_docs.replace_section(COVERAGE.read_text(), sweep_docs.section(archs, results)))
    README.write_text(sweep_docs.replace_readme_sentence(README.read_text(),
                                                         sweep_docs.readme_sentence(archs, results)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ARCH", help="these architectures (NONE: no sweep)")
    parser.add_argument("--resume", action="store_true", help="skip architectures already in the results")
    parser.add_argument("--write-docs", action="store_true", help="write docs/coverage.md and README.md's sentence")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per architecture")
    parser.add_argument("--work", type=Path, default=WORK, help="checkpoints and worker logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--channel-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.channel_fd, args.work)
        return 0
    table = sweep_table()
    results = load_results(args.results)
    chosen = [a for a in (args.only or table) if a != "NONE"]
    unknown = [a for a in chosen if a not in table]
    if unknown:
        parser.error(f"not in the architecture table: {', '.join(unknown)}")
    if args.resume:
        chosen = [a for a in chosen if a not in results["architectures"]]
    started = time.monotonic()
    sweep(chosen, table, results, args.results, args.work, args.timeout)
    print(f"swept {len(chosen)} architectures in {time.monotonic() - started:.0f} s", flush=True)
    if args.write_docs:
        write_docs(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
