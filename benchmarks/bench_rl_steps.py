"""How much of a bf16 checkpoint an RL-like AdamW step changes, and how large its sparse delta is.

An fp32 master copy of a weight tensor (normal, std 0.02, the usual init
scale) is trained with AdamW on fresh random gradients each step (a stand-in
for the noisy policy gradients of RL; Adam normalizes their scale away) and
cast to bf16 after each step, as a trainer exports it. After WARMUP steps
(the master weights are then off the bf16 grid, as in a run long under way),
one more step is taken and measured: the fraction of bf16 values that
changed, and the delta's bytes over the full tensor's, in format v2 (what
`save_checkpoint(base=...)` and `layerwise delta` write: gaps and bit
differences, zstd-compressed) and in format v1 (an int32 index or a bitmap,
and the raw new values), both by `checkpoint.delta.encode.encode_patch`.

Run: `python -m benchmarks.bench_rl_steps [--elements N] [--json]`. Synthetic
gradients: the figures say what a step at these learning rates does to bf16
rounding, not what a given model's training does.
"""

from __future__ import annotations

import argparse
import json

from layerwise_cli.checkpoint.delta.encode import encode_patch

LEARNING_RATES = (1e-6, 3e-6, 1e-5)
WARMUP = 20


def measure(lr: float, elements: int, seed: int = 0, warmup: int = WARMUP) -> dict:
    """One learning rate: the changed fraction and the delta's size after WARMUP steps, for one more step.

    Returns:
        `lr`, `changed_fraction`, `delta_over_full` and `layout` (sparse or whole) of format v2, and
        `v1_over_full` and `v1_layout` (index, bitmap or whole) of format v1.
    """
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    gen = torch.Generator().manual_seed(seed)
    master = torch.nn.Parameter(torch.randn(elements, generator=gen) * 0.02)
    optimizer = torch.optim.AdamW([master], lr=lr, weight_decay=0.0)

    def step() -> None:
        optimizer.zero_grad()
        master.grad = torch.randn(elements, generator=gen)
        optimizer.step()

    for _ in range(warmup):
        step()
    before = master.detach().to(torch.bfloat16)
    step()
    after = master.detach().to(torch.bfloat16)
    raw_before = before.view(torch.uint8).numpy()
    raw_after = after.view(torch.uint8).numpy()
    changed = int((before.view(torch.int16) != after.view(torch.int16)).sum())
    row = {"lr": lr, "changed_fraction": changed / elements}
    for version, prefix in ((2, ""), (1, "v1_")):
        encoded = encode_patch("w", "BF16", (elements,), raw_before, raw_after, version=version)
        row[f"{prefix or 'delta_'}over_full"] = (encoded.nbytes if encoded is not None else 0) / (2 * elements)
        row[f"{prefix}layout"] = encoded.patch.kind if encoded is not None else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22, help="values in the tensor (default 4M)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    rows = [measure(lr, args.elements) for lr in LEARNING_RATES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| lr | values changed | v2 / full bf16 | v2 layout | v1 / full bf16 | v1 layout | v2 / v1 |")
    print("| --- | ---: | ---: | --- | ---: | --- | ---: |")
    for row in rows:
        print(f"| {row['lr']:g} | {row['changed_fraction']:.2%} | {row['delta_over_full']:.4f} | {row['layout']} | "
              f"{row['v1_over_full']:.3f} | {row['v1_layout']} | {row['delta_over_full'] / row['v1_over_full']:.2f} |")


if __name__ == "__main__":
    main()
