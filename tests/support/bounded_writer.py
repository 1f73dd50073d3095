"""Run `save_checkpoint` on a state dict larger than a memory limit, in this process, and print what it cost.

Run as `python -m tests.support.bounded_writer DST MODE` by `tests/test_writer_memory_logic.py`: MODE `stream`
hands the writer a generator that makes one tensor at a time; MODE `hold` first makes every tensor (what a
writer that keeps the whole state dict would hold), as a control that the limit and the measurement bite.

The limit is real: after a warm-up write (imports, torch's thread pool), the address space is capped at
what the process maps then plus LIMIT_MIB (RLIMIT_AS), and the peak resident set (VmHWM, reset through
/proc/self/clear_refs) is printed as JSON with the state dict's size.
"""

from __future__ import annotations

import json
import random
import resource
import sys

from layerwise_cli.writer.save import save_checkpoint

TENSOR_SHAPE = (4096, 2048)  # bf16: 16 MiB
LAYERS = 16  # two tensors per layer: 32 tensors, 512 MiB
LIMIT_MIB = 160


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def tensors():
    """The state dict, one tensor at a time, in shuffled layer order; each is made only when asked for."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    names = [f"model.layers.{i}.mlp.{p}.weight" for i in range(LAYERS) for p in ("up_proj", "down_proj")]
    random.Random(0).shuffle(names)
    for index, name in enumerate(names):
        yield name, torch.full(TENSOR_SHAPE, float(index % 7) / 8, dtype=torch.bfloat16)


def main() -> None:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    dst, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    save_checkpoint(iter([("model.layers.0.mlp.up_proj.weight", torch.ones(4, 4, dtype=torch.bfloat16))]),
                    dst + "-warmup")
    limit = _status("VmSize") + LIMIT_MIB * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    total = 2 * LAYERS * TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 2
    outcome = "ok"
    try:
        source = list(tensors()) if mode == "hold" else tensors()
        saved = save_checkpoint(source, dst, max_shard_size=64 * 2**20, marker="STABLE")
        assert saved.total_bytes == total
    except MemoryError:
        outcome = "out of memory"
    except RuntimeError as exc:  # torch's allocator reports ENOMEM as a RuntimeError
        if "can't allocate memory" not in str(exc):
            raise
        outcome = "out of memory"
    print(json.dumps({"outcome": outcome, "state_dict_bytes": total, "limit_bytes": LIMIT_MIB * 2**20,
                      "rss_rise_bytes": _status("VmHWM") - base}))


if __name__ == "__main__":
    main()
