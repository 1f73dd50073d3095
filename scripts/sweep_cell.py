"""One cell of the family sweep, run in a worker process: an architecture's engines and reloads.

`run_cell(arch, root, report)` writes checkpoints A and B of ARCH, starts an
engine fresh on B (its greedy tokens and top-5 logprobs, asked twice to see
whether the engine answers the same twice, and every tensor's checksum), then
one engine on A into which it reloads with layerwise B, A, B, comparing after
each B with the fresh engine, then reloads A with layerwise and B with vLLM's
own `reload_weights`, compared the same way. REPORT receives each part of the
result as soon as it is known, so that the parent keeps what a later crash
would lose.

`worker_main()` is the worker: it reads architecture names, one a line, and
writes one JSON line per message on the file descriptor the parent gave it
(vLLM's logs go to stdout and stderr, which the parent sends to a log file).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import layerwise_cli
from layerwise_cli.errors import LayerwiseError
from scripts.sweep_build import write_pair
from tests.support import in_process
from tests.support.engine_support import differing_prompts, engine_state, greedy_with_logprobs
from tests.support.in_process import start_here, stop_here

# In the demo tokenizer's vocabulary: Qwen2's tokenizer class drops unknown words ("a b" became an empty prompt).
PROMPTS = ["1 2 3", "4 + 5 =", "7 7 7 7", "15 7 = "]
MAX_TOKENS = 3
TABLE = Path(__file__).resolve().parent.parent / "layerwise_cli" / "planning" / "architectures.json"
FIRST_NAMES = 5  # differing tensors listed by name (the count is always given)


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """An error as one trimmed line: its type and the first line of its message."""
    if isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        error = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
    error = " ".join(str(error).split())
    return error if len(error) <= limit else error[: limit - 3] + "..."


def uses_mla(checkpoint: Path) -> bool:
    """Whether the model's attention is MLA (DeepSeek's latent attention): its config has `kv_lora_rank`."""
    config = json.loads((checkpoint / "config.json").read_text())
    return any(isinstance(part, dict) and part.get("kv_lora_rank") for part in (config, config.get("text_config")))


def answers(llm) -> list:
    return greedy_with_logprobs(llm, PROMPTS, max_tokens=MAX_TOKENS)


def checksums(llm) -> dict:
    return engine_state(llm)["checksums"]


def compare(llm, fresh: dict) -> dict:
    """How LLM's answers and tensors compare with the fresh engine's (FRESH: `tokens`, `checksums`)."""
    # Answers first, then checksums, in the order `fresh_reference` took them: a forward pass changes some
    # buffers (gpt-oss's `rotary_emb.cos_sin_cache` differed when checksummed before the first generate).
    tokens_equal = not differing_prompts(answers(llm), fresh["tokens"])
    state = checksums(llm)
    names = sorted(set(state) | set(fresh["checksums"]))
    differ = [name for name in names if state.get(name) != fresh["checksums"].get(name)]
    return {"tokens_equal": tokens_equal, "tensors_differ": len(differ),
            "first_differing": differ[:FIRST_NAMES], "tensors": len(names)}


def outcome(comparisons: list[dict], *, judge_by_state: bool) -> dict:
    """equal (tokens and every tensor, after each B) or wrong (which tensors, whether tokens), from COMPARISONS."""
    state_equal = all(c["tensors_differ"] == 0 for c in comparisons)
    tokens_equal = all(c["tokens_equal"] for c in comparisons)
    result = {"outcome": "equal" if state_equal and (tokens_equal or judge_by_state) else "wrong",
              "tokens_equal": tokens_equal, "comparisons": comparisons}
    worst = max(comparisons, key=lambda c: c["tensors_differ"])
    if worst["tensors_differ"]:
        result["first_differing"] = worst["first_differing"]
        result["tensors_differ"] = worst["tensors_differ"]
    return result


def fresh_reference(b: Path) -> dict:
    """An engine started fresh on B: its answers (asked twice) and every tensor's checksum."""
    llm = start_here(str(b))
    try:
        try:
            tokens = answers(llm)
        except Exception as exc:  # it started, and cannot answer
            raise RuntimeError(f"started, then its first generate failed: {one_line(exc)}") from exc
        stable = not differing_prompts(answers(llm), tokens)
        return {"tokens": tokens, "stable": stable, "checksums": checksums(llm)}
    finally:
        stop_here(llm)


def layerwise_cell(llm, a: Path, b: Path, fresh: dict, judge_by_state: bool) -> dict:
    """Layerwise's reloads B, A, B into LLM (started on A), compared with FRESH after each B."""
    comparisons = []
    try:
        for source in (b, a, b):
            layerwise_cli.reload(llm, str(source))
            if source == b:
                comparisons.append(compare(llm, fresh))
    except LayerwiseError as exc:
        return {"outcome": "refused", "error": one_line(exc)}
    except Exception as exc:  # noqa: BLE001 - anything else is a crash of the reload (or the engine)
        return {"outcome": "crashed", "error": one_line(exc)}
    return outcome(comparisons, judge_by_state=judge_by_state)


def vllm_cell(llm, a: Path, b: Path, fresh: dict, judge_by_state: bool) -> dict:
    """vLLM's own `reload_weights` of B into LLM (put back on A by layerwise first), compared with FRESH."""
    with contextlib.suppress(LayerwiseError):  # then the engine still holds A: refused, or rolled back
        layerwise_cli.reload(llm, str(a), all_layers=True)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
    except Exception as exc:  # noqa: BLE001 - vLLM's own error, whatever its type
        return {"outcome": "refused", "error": one_line(exc)}
    try:
        return outcome([compare(llm, fresh)], judge_by_state=judge_by_state)
    except Exception as exc:  # noqa: BLE001 - the engine died after the reload
        return {"outcome": "crashed", "error": one_line(exc)}


def run_cell(arch: str, root: Path, report) -> None:
    """Build, start and reload ARCH (checkpoints under ROOT); REPORT(part, value) for each part of the result."""
    started = time.monotonic()
    try:
        a, b = write_pair(arch, root)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the cell's outcome
        report("build", {"outcome": "cannot build", "error": one_line(exc)})
        return
    report("build", {"outcome": "built", "seconds": round(time.monotonic() - started, 1)})
    report("stage", "fresh engine on B")
    try:
        fresh = fresh_reference(b)
    except Exception as exc:  # noqa: BLE001 - the engine's own error
        report("start", {"outcome": "cannot start", "error": one_line(exc)})
        return
    judge_by_state = uses_mla(b) or not fresh["stable"]
    report("start", {"outcome": "started", "fresh_tokens_stable": fresh["stable"], "mla": uses_mla(b),
                     "tensors": len(fresh["checksums"])})
    report("stage", "engine on A")
    try:
        llm = start_here(str(a))
    except Exception as exc:  # noqa: BLE001
        report("start", {"outcome": "cannot start", "error": one_line(f"on A after B started: {one_line(exc)}")})
        return
    try:
        report("stage", "layerwise reloads")
        report("layerwise", layerwise_cell(llm, a, b, fresh, judge_by_state))
        report("stage", "vLLM's own reload")
        report("vllm", vllm_cell(llm, a, b, fresh, judge_by_state))
    finally:
        stop_here(llm)
        report("seconds", round(time.monotonic() - started, 1))


def worker_main(channel_fd: int, work_root: Path) -> None:
    """Run the cells of the architectures read from stdin, one a line; messages on CHANNEL_FD as JSON lines."""
    channel = os.fdopen(channel_fd, "w", buffering=1)
    table = json.loads(TABLE.read_text())["architectures"]
    keeps_state_here = in_process._keeps_state_here

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")

    for line in sys.stdin:
        arch = line.strip()
        if not arch:
            continue
        root = work_root / arch
        shutil.rmtree(root, ignore_errors=True)
        # Outside the table: vLLM's Transformers backend (`sweep_families.FALLBACK`).
        on_transformers_backend = table.get(arch, {}).get("backend", "transformers") == "transformers"
        # vLLM's Transformers backend patches transformers' classes for the process's lifetime, which is why
        # `start_here` starts those the default way (about 45 s a start here, against 3 s). Both checkpoints
        # are written before any engine starts, and the worker is restarted after the cell: in process here.
        in_process._keeps_state_here = keeps_state_here
        if on_transformers_backend:
            in_process._keeps_state_here = lambda model: keeps_state_here(model) if "llvmlite" in sys.modules else None
        failed = False
        try:
            run_cell(arch, root, lambda part, value, arch=arch: send({"arch": arch, "part": part, "value": value}))
        except Exception as exc:  # noqa: BLE001 - whatever breaks the cell, the next one gets a new worker
            traceback.print_exc()
            send({"arch": arch, "part": "error", "value": one_line(exc)})
            failed = True
        shutil.rmtree(root, ignore_errors=True)
        # An engine on vLLM's Transformers backend, or llvmlite loaded, leaves this process unfit (in_process.py).
        send({"arch": arch, "part": "done",
              "value": {"restart": failed or on_transformers_backend or "llvmlite" in sys.modules}})
