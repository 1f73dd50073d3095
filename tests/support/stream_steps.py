"""The steps the streaming engine tests reload from a Hub or an object store: a Qwen3 shape of 4 decoder layers.

About 30 MB each, written by `save_checkpoint` (header digests, 8 MiB shards) with the demo's tokenizer, so that
a step of every layer new, or of one layer new, is drawn from seeds alone.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from layerwise_cli.demo import demo_prompt
from layerwise_cli.writer.save import save_checkpoint
from tests.support.synthetic import SyntheticModel

MODEL = SyntheticModel(layers=4, hidden=512, heads=4, kv_heads=2, head_dim=128, intermediate=2048, vocab=128)
PROMPTS_PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3)]


def stream_prompts() -> list[str]:
    """The 8 prompts these engines are compared on."""
    return [demo_prompt(a, b) for a, b in PROMPTS_PAIRS]


def step_tensors(seeds: dict[int, int], default: int) -> dict:
    """MODEL's tensors: decoder layer i drawn from seed `seeds.get(i, default)`, the rest from DEFAULT."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    out = {}
    for name, shape in MODEL.tensors():
        match = re.search(r"\.layers\.(\d+)\.", name)
        seed = seeds.get(int(match.group(1)), default) if match else default
        generator = torch.Generator().manual_seed(seed * 1000 + len(out))
        value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        out[name] = value.to(torch.bfloat16)
    return out


def write_step(folder: Path, tensors: dict, tokenizer: Path) -> Path:
    """TENSORS saved into FOLDER as a step of MODEL, with TOKENIZER's tokenizer files; FOLDER."""
    save_checkpoint(tensors.items(), folder, max_shard_size=8 << 20, marker=None, allow_nonfinite=True)
    for path in tokenizer.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(path, folder / path.name)
    (folder / "config.json").write_text(json.dumps(MODEL.config()))
    return folder
