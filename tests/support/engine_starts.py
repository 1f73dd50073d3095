"""Counting the engines and servers each test file starts (LAYERWISE_TEST_STARTS=FILE), to see where CI time goes.

Counted in the test's process, by kind:

- `in_process`: a vLLM `LLM` built with the engine core and worker in this process (`start_here`);
- `engine`: a vLLM `LLM` built the default way (engine-core and worker processes of its own, several ranks too);
- `server`: a server process (`layerwise serve`, a headless node of one, vLLM's own OpenAI server);
- `cli_engine`: a `layerwise` command in a subprocess that starts an engine itself (`--model`, `demo`);
- `script`: a Python subprocess whose code builds an engine (`LLM(` or `start_engine(` in its `-c` text), or a
  benchmark (`-m benchmarks.bench_...`), which starts its engines itself.

A default-layout engine or a server costs 30 to 60 s to start on a 2-core machine, an in-process one a few
seconds. An engine a subprocess's subprocess starts is not seen. Counting imports vLLM in each test process
before its first file (seconds that file's line then includes). `scripts/engine_starts.py` turns the lines into
a table per file, beside the seconds of `LAYERWISE_TEST_TIMELINE` or `--durations`.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess

from layerwise_cli.engine_cpus import MULTIPROCESSING_ENV

FILE_ENV = "LAYERWISE_TEST_STARTS"
KINDS = ("in_process", "engine", "server", "cli_engine", "script")

_counts: collections.Counter[str] = collections.Counter()
_installed = False


def kind_of_command(argv: list[str]) -> str | None:
    """Which kind of start the subprocess ARGV is (KINDS), or None when it starts no engine."""
    words = [str(word) for word in argv]
    text = " ".join(words)
    if "vllm.entrypoints.openai.api_server" in text:
        return "server"
    programs = [i for i, word in enumerate(words) if os.path.basename(word) == "layerwise"
                or word in ("layerwise_cli", "layerwise_cli.cli.app", "layerwise_cli.server.launch")]
    if programs:
        rest = words[programs[0] + 1:]
        if words[programs[0]] == "layerwise_cli.server.launch" or rest[:1] == ["serve"]:
            return "server"
        return "cli_engine" if "--model" in rest or rest[:1] == ["demo"] else None
    if "-c" in words and any(call in text for call in ("LLM(", "start_engine(")):
        return "script"
    if any(word.startswith("benchmarks.bench_") for word in words):  # a benchmark starts its engines itself
        return "script"
    return None


def install() -> None:
    """Count from now on, in this process: wrap `vllm.LLM.__init__` (where vLLM is installed: the Hub floor's venv
    has none, and its run inherits the variable from CI's) and `subprocess.Popen.__init__` once."""
    global _installed
    if _installed:
        return
    _installed = True
    if importlib.util.find_spec("vllm") is not None:
        _count_llm_starts()
    popen_init = subprocess.Popen.__init__

    def counted_popen_init(self, args, *rest, **kwargs):
        kind = kind_of_command([args] if isinstance(args, str | bytes | os.PathLike) else list(args))
        if kind is not None:
            _counts[kind] += 1
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counted_popen_init


def _count_llm_starts() -> None:
    """Wrap `vllm.LLM.__init__`: an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or the default way."""
    from vllm import LLM  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    llm_init = LLM.__init__

    def counted_llm_init(self, *args, **kwargs):
        in_process = os.environ.get(MULTIPROCESSING_ENV) == "0"
        _counts["in_process" if in_process else "engine"] += 1
        llm_init(self, *args, **kwargs)

    LLM.__init__ = counted_llm_init


def take() -> dict[str, int]:
    """The starts counted since the last call, by kind (every kind listed), and start counting afresh."""
    out = {kind: _counts.get(kind, 0) for kind in KINDS}
    _counts.clear()
    return out


def line(worker: str, test_file: str, seconds: float, starts: dict[str, int]) -> str:
    """One line of the starts file: worker, file, seconds, then `kind=count` for every kind."""
    return " ".join([worker, test_file, f"{seconds:.0f}", *(f"{kind}={starts[kind]}" for kind in KINDS)]) + "\n"
