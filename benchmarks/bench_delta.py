"""The reload benchmark's delta cases: reloading a checkpoint the engine mostly or wholly holds already.

Every case starts from BASE (the in-order checkpoint, with header digests)
held *through layerwise*: before each timed layerwise reload, an untimed
`layerwise reload BASE` of every layer (skip off) runs first, so the workers
have recorded BASE's layer digests. Then one of these is timed:

    f        25% of the parent layers changed (every element of their tensors one
             unit in the last place off: still real weights), header digests
    g        identical to BASE (BASE's files hard-linked into another folder),
             header digests: the skip decision needs the headers only
    g-plain  identical, without header digests: layerwise reads and hashes
             every byte to decide (the read limit is the bar)
    h        `save_checkpoint`'s output of f's tensors (shards in layer order,
             header digests): the trainer-side writer's checkpoint
    s        a sparse delta (`layerwise delta`, docs/deltas.md) of an RL-like
             step: 3% of the values of every tensor one unit in the last place
             off, the rest as BASE; c loads the delta, and `c-full` the full
             step it rebuilds
    rl-LR    the same at the fraction of values one AdamW step at learning
             rate LR (1e-6, 3e-6, 1e-5) changes on fp32 master weights cast to
             bf16, measured in the same run (`bench_rl_steps.measure`)

and, for each, vLLM's own reload of the same checkpoint (a) and the read limit
(d); for s, of the full step (vLLM cannot read a delta). The parent layers
changed in f and h are a seeded sample of 25% of them by count that also
holds 25% (+-2.5 points) of the bytes (`changed_layers`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

from safetensors import safe_open

from benchmarks.bench_checkpoints import STAMP, TOKENIZER_FILES, write_bench_checkpoint
from benchmarks.bench_rl_steps import measure
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.writer.delta_step import write_delta
from layerwise_cli.writer.save import save_checkpoint

# The learning rates of the RL-like AdamW steps (issue 49), by case.
RL_CASES = {"rl-1e-6": 1e-6, "rl-3e-6": 3e-6, "rl-1e-5": 1e-5}
# The cases a run takes unless told (the RL steps take three more full steps' writing: asked for by name).
DEFAULT_CASES = ("f", "g", "g-plain", "h", "s")
DELTA_CASES = (*DEFAULT_CASES, *RL_CASES)
# The cases with a sparse delta and the full step beside it.
SPARSE_CASES = ("s", *RL_CASES)
DELTA_NAMES = {
    "f": "25% of layers changed, header digests",
    "g": "identical, header digests",
    "g-plain": "identical, no header digests",
    "h": "save_checkpoint's output of f",
    "s": "sparse delta, 3% of values changed",
    **{case: f"sparse delta, an AdamW step at lr {lr:g}" for case, lr in RL_CASES.items()},
}
# `c-full`: layerwise on the full step a sparse delta rebuilds; `c-nopatch`: the delta with nothing patched in
# place, every changed layer rebuilt from the base and handed to vLLM; `p`: the delta's write limit, its new values
# written at their positions and nothing else (`layerwise_bench_patch_floor`) (case s only).
DELTA_VARIANTS = ("a", "c", "c-full", "c-nopatch", "d", "p")
# The variants only a case with a full step beside its delta (s) has.
SPARSE_ONLY = ("c-full", "c-nopatch", "p")
CHANGED_FRACTION = 0.25
# The fraction of every tensor's values case s changes (issue 49's figure).
SPARSE_FRACTION = 0.03


def changed_layers(base: Path, seed: int = 0) -> tuple[list[str], dict[str, str]]:
    """25% of BASE's parent layers by count, holding 25% (+-2.5 points) of its bytes; each tensor's parent layer.

    A seeded sample by count alone can draw mostly large layers (or small
    ones): the first seed from SEED whose sample also holds about a quarter of
    the bytes is taken, so that "25% changed" means both (or, when no seed
    of 1000 does, as with a tiny model whose embeddings dominate, the closest).
    """
    plan = inspect_order(str(base)).plan
    sizes = {layer.name: layer.bytes for layer in plan.layers}
    total = sum(sizes.values())
    count = max(1, round(CHANGED_FRACTION * len(sizes)))
    best: tuple[float, list[str]] | None = None
    for attempt in range(seed, seed + 1000):
        sample = sorted(random.Random(attempt).sample(sorted(sizes), count))
        off = abs(sum(sizes[name] for name in sample) / total - CHANGED_FRACTION)
        if best is None or off < best[0]:
            best = (off, sample)
        if off <= 0.025:
            break
    chosen = best[1]
    parent_of = {item.entry.name: item.parent for item in plan.layer_order if item.parent is not None}
    return chosen, parent_of


def perturbed(data, tensors: set[str]):
    """A `data` source equal to DATA except for TENSORS, whose every bf16 element is one ulp off (still finite)."""
    import numpy as np  # noqa: PLC0415 - numpy: heavy (`--help` stays fast)

    def read(name: str, nbytes: int) -> bytes:
        raw = data(name, nbytes)
        if name not in tensors:
            return raw
        return (np.frombuffer(raw, dtype=np.uint16) ^ np.uint16(1)).tobytes()

    return read


def sparsely_perturbed(data, fraction: float, seed: int = 0):
    """A `data` source equal to DATA except that FRACTION of every tensor's bf16 values (seeded positions, drawn
    per tensor) are one unit in the last place off (still finite): an RL-like step."""
    import numpy as np  # noqa: PLC0415 - numpy: heavy (`--help` stays fast)

    def read(name: str, nbytes: int) -> bytes:
        values = np.frombuffer(data(name, nbytes), dtype=np.uint16).copy()
        rng = np.random.default_rng([seed, *name.encode()])
        values[rng.random(values.size) < fraction] ^= np.uint16(1)
        return values.tobytes()

    return read


def _write_sparse(workdir: Path, model, tokenizer: Path, data, base: dict, case: str) -> dict:
    """Case s or rl-LR: the full step (a fraction of the values changed) and its delta against BASE (`write_delta`).

    Case s changes SPARSE_FRACTION of them; rl-LR the fraction one AdamW step at LR changes
    (`bench_rl_steps.measure`, on 4M values, in this run: `adamw` in the result).
    """
    adamw = None
    fraction = SPARSE_FRACTION
    if case in RL_CASES:
        adamw = measure(RL_CASES[case], 1 << 22)
        fraction = adamw["changed_fraction"]
    prefix = "sparse" if case == "s" else case
    full = write_bench_checkpoint(workdir / f"{prefix}-full", model, "in_order", tokenizer,
                                  sparsely_perturbed(data, fraction), digests=True, variant=f"sparse:{fraction}")
    out = workdir / f"{prefix}-delta"
    saved = write_delta(base["path"], full["path"], out, marker=None, overwrite=True)
    if saved.delta is None:
        raise RuntimeError(f"case {case}: layerwise delta wrote a full copy ({saved.fallback})")
    return {"path": str(out), "full_path": full["path"], "layout": "delta", "bytes": saved.total_bytes,
            "full_bytes": full["bytes"], "changed_values": saved.delta.changed_values,
            "changed_fraction": saved.delta.changed_values / (full["bytes"] // 2), "adamw": adamw}


def _link_tree(src: Path, dst: Path) -> None:
    """DST holds SRC's files (hard links: the same bytes, no space), under another name."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file():
            try:
                os.link(path, dst / path.name)
            except OSError:
                shutil.copy2(path, dst / path.name)


def _write_with_writer(src: Path, dst: Path, config: dict, tokenizer: Path) -> dict:
    """`save_checkpoint` of SRC's tensors, one at a time (a generator), reused when SRC has not changed."""
    stamp = {"source": json.loads((src / STAMP).read_text())["stamp"], "writer": 1}
    if (dst / STAMP).is_file() and json.loads((dst / STAMP).read_text()).get("stamp") == stamp:
        return json.loads((dst / STAMP).read_text())["checkpoint"]

    def tensors():
        for path in sorted(src.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, f.get_tensor(name)

    saved = save_checkpoint(tensors(), dst, config=config, overwrite=True, marker=None)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, dst / name)
    checkpoint = {"path": str(dst), "layout": "save_checkpoint", "shards": len(saved.shards),
                  "bytes": saved.total_bytes, "tensors": saved.tensors, "header_digests": True,
                  "write_s": saved.seconds}
    (dst / STAMP).write_text(json.dumps({"stamp": stamp, "checkpoint": checkpoint}))
    return checkpoint


def write_delta_checkpoints(workdir: Path, model, tokenizer: Path, data, cases: list[str],
                            plain_twin: Path | None = None) -> dict:
    """BASE and the checkpoints of CASES, in WORKDIR.

    Args:
        plain_twin: a checkpoint with BASE's tensors in BASE's layout but no
            header digests (the benchmark's in-order checkpoint), hard-linked
            for g-plain instead of writing it again.

    Returns:
        `{"base": info, "changed_layers": [...], "changed_bytes": n, <case>: info, ...}`.
    """
    base = write_bench_checkpoint(workdir / "base", model, "in_order", tokenizer, data, digests=True)
    out: dict = {"base": base}
    chosen, parent_of = changed_layers(Path(base["path"]))
    tensors = {name for name, parent in parent_of.items() if parent in set(chosen)}
    shapes = dict(model.tensors())
    out["changed_layers"] = chosen
    out["parent_layers"] = len(set(parent_of.values()))
    out["changed_bytes"] = sum(2 * _numel(shapes[name]) for name in tensors)
    if "f" in cases or "h" in cases:
        out["f"] = write_bench_checkpoint(workdir / "changed", model, "in_order", tokenizer, perturbed(data, tensors),
                                          digests=True, variant="changed:" + ",".join(chosen))
    if "g" in cases:
        _link_tree(Path(base["path"]), workdir / "identical")
        out["g"] = {**base, "path": str(workdir / "identical")}
    if "g-plain" in cases:
        if plain_twin is not None:
            _link_tree(plain_twin, workdir / "identical-plain")
            out["g-plain"] = {**base, "path": str(workdir / "identical-plain"), "header_digests": False}
        else:
            out["g-plain"] = write_bench_checkpoint(workdir / "identical-plain", model, "in_order", tokenizer, data)
    if "h" in cases:
        out["h"] = _write_with_writer(Path(out["f"]["path"]), workdir / "writer", model.config(), tokenizer)
    for case in SPARSE_CASES:
        if case in cases:
            out[case] = _write_sparse(workdir, model, tokenizer, data, base, case)
    if "f" not in cases:
        out.pop("f", None)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bench_delta(llm, delta: dict, cases: list[str], args, watch, device_memory, measure, log,
                deadline: float | None = None) -> dict:
    """Time a, c (layerwise, skipping unchanged layers) and d on each case's checkpoint, BASE held first.

    Before every timed layerwise run, BASE is reloaded through layerwise with
    every layer (untimed): the workers then hold and have recorded BASE. vLLM's
    own reload (a) and the read limit (d) do not depend on what the engine
    holds. Runs are interleaved (cases and variants rotate each round).

    Returns:
        `{"results": [per case: times, ratios, ...], "base_reload_s_median": s}`.

    Args:
        measure: `bench_measure.measure(llm, variant, path, cuda, full=...)`.
        watch: the `MemoryWatch` (engine RSS rise per call).
        device_memory: the `DeviceMemory` (peak allocated rise per call on a GPU), or None (CPU).
    """
    base = Path(delta["base"]["path"])
    variants = [v for v in args.delta_variants if v in DELTA_VARIANTS]
    case_variants = {case: [v for v in variants if v not in SPARSE_ONLY or "full_path" in delta[case]]
                     for case in cases}
    samples: dict[str, dict[str, list[dict]]] = {case: {v: [] for v in case_variants[case]} for case in cases}
    pairs = [(case, v) for case in cases for v in case_variants[case]]
    for _ in range(args.warmup):  # untimed: the skip's code paths warm, as the other variants' are
        for case in cases:
            measure(llm, "c", base, args.cuda, full=True)
            measure(llm, "c", Path(delta[case]["path"]), args.cuda, full=False)
    prepare_s: list[float] = []
    round_s = 0.0
    for run in range(args.runs):
        started = time.perf_counter()
        if run > 0 and deadline is not None and started + round_s > deadline:
            log(f"  delta: stopping after {run} runs (--time-budget)")
            break
        shift = run % len(pairs)
        for case, variant in pairs[shift:] + pairs[:shift]:
            path = _variant_path(delta[case], variant)
            if variant in ("c", *SPARSE_ONLY):
                began = time.perf_counter()
                measure(llm, "c", base, args.cuda, full=True)  # the engine holds BASE, through layerwise
                prepare_s.append(time.perf_counter() - began)
            before = watch.reset()
            if device_memory is not None:
                device_memory.reset()
            sample = measure(llm, "c" if variant == "c-full" else variant, path, args.cuda, full=False)
            sample["engine_peak_rss_delta_bytes"] = watch.engine_peak_delta(before)
            sample["device_peak_allocated_delta_bytes"] = device_memory.rise() if device_memory else None
            samples[case][variant].append(sample)
        round_s = time.perf_counter() - started
        log(f"  delta run {run + 1}/{args.runs}: " + "  ".join(
            f"{case}/{v} {samples[case][v][-1]['seconds']:.2f}s" for case, v in pairs))
    results = []
    for case in cases:
        times = {}
        for v in case_variants[case]:
            got = samples[case][v]
            times[v] = {"median": statistics.median(s["seconds"] for s in got),
                        "min": min(s["seconds"] for s in got), "max": max(s["seconds"] for s in got),
                        "samples": [s["seconds"] for s in got],
                        "engine_peak_rss_delta_bytes": statistics.median(
                            s["engine_peak_rss_delta_bytes"] for s in got)}
            rises = [s["device_peak_allocated_delta_bytes"] for s in got
                     if s["device_peak_allocated_delta_bytes"] is not None]
            times[v]["device_peak_allocated_delta_bytes"] = statistics.median(rises) if rises else None
            for key in ("skipped_layers", "skipped_bytes", "reloaded_bytes", "read_bytes", "spot_check_bytes",
                        "patched_layers", "patched_bytes"):
                values = [s[key] for s in got if s.get(key) is not None]
                if values:
                    times[v][key] = max(values)
            for key in ("hash_s", "fingerprint_s", "spot_check_s", "patch_s"):
                values = [s[key] for s in got if s.get(key) is not None]
                if values:
                    times[v][f"{key}_median"] = statistics.median(values)
        results.append({"case": case, "name": DELTA_NAMES[case], "checkpoint": delta[case],
                        "runs": len(samples[case][case_variants[case][0]]), "times": times,
                        "ratios": delta_ratios(times)})
    return {"results": results, "base_reload_s_median": statistics.median(prepare_s) if prepare_s else None}


def _variant_path(case: dict, variant: str) -> Path:
    """The checkpoint VARIANT reads in CASE: a sparse delta's full step for everything but layerwise's c."""
    return Path(case["path"] if variant in ("c", "c-nopatch", "p") or "full_path" not in case else case["full_path"])


def delta_ratios(times: dict) -> dict:
    """c over a, over c-full (layerwise on the full step, case s) and over the read limit d, and the write limit p
    over c-full, for one case."""
    med = {v: t["median"] for v, t in times.items()}
    ratios = {}
    if "a" in med and "c" in med:
        ratios["c_over_a"] = med["c"] / med["a"]
    if "c-full" in med and "c" in med:
        ratios["c_over_c_full"] = med["c"] / med["c-full"]
    if "c-full" in med and "c-nopatch" in med:
        ratios["c_nopatch_over_c_full"] = med["c-nopatch"] / med["c-full"]
    if "c-full" in med and "p" in med:
        # The least c / c-full any way of loading the delta reaches on this machine: its writes alone.
        ratios["p_over_c_full"] = med["p"] / med["c-full"]
    if "d" in med and "c" in med:
        ratios["c_over_d"] = med["c"] / med["d"]
    return ratios
