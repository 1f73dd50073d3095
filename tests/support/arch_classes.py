"""Compare the architecture table with the classes vLLM imports: `python -m tests.support.arch_classes TABLE.json`.

Prints `{"checked": N, "differ": [...]}`. It runs in a process of its own:
importing every model class loads packages (numba's llvmlite among them) that
stay in the importing process, and vLLM's CPU worker then fails to start an
engine in that process (its kernel rebinding walks every loaded module).
"""

from __future__ import annotations

import importlib
import json
import sys


def compare(table: dict) -> dict:
    """The source reader's class attributes against the imported classes' (the rest are read from source only)."""
    checked = 0
    differ = []
    for arch, entry in table["architectures"].items():
        if entry["backend"] == "transformers" or entry["notes"]:
            continue  # fused at engine start; or read partly, which the entry says
        module, _, name = entry["class"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - torchvision and other packages this machine lacks
            continue
        packed = {k: list(v) for k, v in (getattr(cls, "packed_modules_mapping", None) or {}).items()}
        mapper = getattr(cls, "hf_to_vllm_mapper", None)
        live = {}
        for field, key in (("orig_to_new_prefix", "prefix"), ("orig_to_new_substr", "substr"),
                           ("orig_to_new_suffix", "suffix"), ("orig_to_new_regex", "regex"),
                           ("orig_to_new_stacked", "stacked")):
            value = getattr(mapper, field, None)
            if value:
                live[key] = [[k.pattern if key == "regex" else k, list(v) if key == "stacked" else v]
                             for k, v in value.items()]
        # The table also holds the entries a class adds in __init__ (DeepSeek's conditional qkv_proj).
        if any(entry["packed_modules_mapping"].get(k) != v for k, v in packed.items()) or live != entry["mapper"]:
            differ.append(arch)
        checked += 1
    return {"checked": checked, "differ": differ}


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        result = compare(json.load(handle))
    print(json.dumps(result))
