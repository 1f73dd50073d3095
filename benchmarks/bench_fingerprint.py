"""What skipping unchanged layers costs and saves: layer fingerprints, hashing while reading, skipped reloads.

    flock /tmp/layerwise-engine.lock .venv/bin/python -m benchmarks.bench_fingerprint --out bench-out/fingerprint

Writes one synthetic Qwen3 checkpoint (about --size-gib, bf16) twice: plain
safetensors (no digests) and through `save_checkpoint` (header digests); starts
one engine and times, median of --runs:

- vLLM's own `reload_weights` (the reference for ratios);
- layerwise `all_layers=True` from each copy (everything loaded, and recorded);
- layerwise again from each copy: nothing changed, everything skipped;
- inside the worker: `model_fingerprints` (verify's digests, kernel read-backs included) against the
  skip check's `layer_fingerprints` of every parent layer, and the torch word checksum
  (`device_checksum`, the path a GPU takes) over the same stored tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.bench_checkpoints import model_for, tokenizer_vocab, write_bench_checkpoint
from layerwise_cli.client.engine.in_process import EngineOptions, reload, start_engine, stop_engine
from layerwise_cli.demo import demo_checkpoint
from layerwise_cli.worker.proof.fingerprints import model_fingerprints
from layerwise_cli.writer.save import save_checkpoint
from tests.support.engine_support import load_tensors
from tests.support.synthetic import normal_weights


def _in_worker(self) -> dict:
    """Time the fingerprints inside a worker (run through `collective_rpc`)."""
    from layerwise_cli.worker.state.layer_state import device_checksum, layer_fingerprints  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    model = self.model_runner.get_model()
    modules = dict(model.named_modules())
    layers = {name: [name] for name, module in modules.items()
              if any(True for _ in module.parameters(recurse=False))}
    stored = [t for m in modules.values() for t in list(m._parameters.values()) + list(m._buffers.values())
              if t is not None and t.device.type != "meta" and t.numel()]
    out = {"layers": len(layers), "stored_bytes": sum(t.numel() * t.element_size() for t in stored),
           "handles": sum(1 for m in modules.values() if getattr(m, "cpu_linear", None) is not None)}
    for label, call in (("layer_fingerprints_s", lambda: layer_fingerprints(modules, layers)),
                        ("device_checksum_s", lambda: [device_checksum(t) for t in stored]),
                        ("model_fingerprints_s", lambda: model_fingerprints(model))):
        samples = []
        for _ in range(1 if label == "model_fingerprints_s" else 3):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        out[label] = min(samples)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/dev/shm/layerwise-bench-fingerprint"))
    parser.add_argument("--out", type=Path, default=Path("bench-out/fingerprint"))
    parser.add_argument("--worker-only", action="store_true", help="only the in-worker fingerprint timings")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The in-worker timing is a function sent through collective_rpc (pickled; a local benchmark engine).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    tokenizer = demo_checkpoint("multiply")
    model = model_for(argparse.Namespace(preset="auto", quick=False, size_gib=args.size_gib),
                      tokenizer_vocab(tokenizer))
    plain = Path(write_bench_checkpoint(args.workdir / "plain", model, "in_order", tokenizer,
                                        normal_weights(model))["path"])
    digests = args.workdir / "digests"
    if not digests.exists():
        save_checkpoint(load_tensors(plain).items(), digests, max_shard_size=300 * 2**20, marker=None)
        for path in plain.iterdir():
            if path.suffix in (".json", ".txt", ".jinja") and path.name != "model.safetensors.index.json":
                shutil.copy2(path, digests / path.name)
    llm = start_engine(str(plain), EngineOptions(max_model_len=256, enforce_eager=True,
                                                 extra={"kv_cache_memory_bytes": 2**28}))
    results: dict = {"bytes": sum(p.stat().st_size for p in plain.glob("*.safetensors"))}
    try:
        def timed(label: str, call) -> None:
            samples, reports = [], []
            for _ in range(args.runs):
                start = time.perf_counter()
                reports.append(call())
                samples.append(time.perf_counter() - start)
            row = {"median_s": statistics.median(samples), "samples": samples}
            if reports[-1] is not None:
                last = reports[-1]
                row.update(skipped_layers=last.unchanged.skipped_layers, layers=len(last.layers),
                           read_bytes=last.volume.read_bytes,
                           hash_s=statistics.median(r.timings.hash_s for r in reports),
                           fingerprint_s=statistics.median(r.timings.fingerprint_s for r in reports),
                           worker_wall_s=statistics.median(r.wall_s for r in reports), digests=last.unchanged.digests)
            results[label] = row
            print(label, json.dumps(row), flush=True)

        if args.worker_only:
            reload(llm, str(digests), all_layers=True)
        else:
            run_reloads(timed, llm, plain, digests, reload)
        results["worker"] = llm.collective_rpc(_in_worker)[0]
        print("worker", json.dumps(results["worker"]), flush=True)
    finally:
        stop_engine(llm)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fingerprint.json").write_text(json.dumps(results, indent=1))
    return 0


def run_reloads(timed, llm, plain: Path, digests: Path, reload) -> None:
    """vLLM's own reload, then layerwise: everything, then nothing changed, from each copy."""
    timed("a_vllm_reload", lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": str(plain)})
          and None)
    timed("all_plain", lambda: reload(llm, str(plain), all_layers=True))
    timed("same_plain", lambda: reload(llm, str(plain)))
    timed("all_digests", lambda: reload(llm, str(digests), all_layers=True))
    timed("same_digests", lambda: reload(llm, str(digests)))


if __name__ == "__main__":
    raise SystemExit(main())
