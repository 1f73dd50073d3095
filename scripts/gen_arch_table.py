"""Generate layerwise's architecture table from the installed vLLM's model sources.

Reads vLLM's model registry and the source of every text-generation model
class with `ast` (no `import vllm`, no torch): class attributes
(`packed_modules_mapping`, `hf_to_vllm_mapper`) are evaluated from the class
bodies and their base classes, and the loaders' fusions and skips from the
`load_weights` code of the modules the class is built from. Reading the
source, not importing it, gives every entry on every machine, including
classes whose modules import packages this machine lacks (Qwen3.5's module
imports torchvision), and takes about a second.

    python scripts/gen_arch_table.py            # rewrite layerwise_cli/planning/architectures.json
    python scripts/gen_arch_table.py --check    # exit 1 if the committed table differs
    python scripts/gen_arch_table.py --vllm-root SRC/vllm --out layerwise_cli/planning/architectures-release.json
                                                # the table of another vLLM (an unpacked release wheel)

Its parts, next to this file: `vllm_source.py` (the `ast` reader),
`loader_facts.py` (what the loader code fuses and skips) and `arch_entry.py`
(one architecture's entry).

The table is stamped with the vLLM version it was read from; the drift test
(tests/test_arch_table.py) regenerates it and fails on any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # its parts, `scripts.*`, however this file is run or loaded
    sys.path.insert(0, str(ROOT))

from scripts.arch_entry import entry_for, rotary_mapper  # noqa: E402
from scripts.vllm_source import VllmSource  # noqa: E402

TABLE = ROOT / "layerwise_cli" / "planning" / "architectures.json"
FORMAT = 1
# Registry dicts whose architectures generate text (vLLM's `registry.py`).
_TEXT_REGISTRIES = ("_TEXT_GENERATION_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")
_MULTIMODAL_REGISTRY = "_MULTIMODAL_MODELS"


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("gen_arch_table: vLLM is not installed in this Python")
    return Path(spec.origin).parent


def _is_text_architecture(name: str) -> bool:
    return name.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) or name == "ChatGLMModel"


def generate(root: Path | None = None) -> dict:
    """The architecture table of the vLLM whose package directory is ROOT (default: the installed one)."""
    root = root or vllm_root()
    src = VllmSource(root)
    version_mod = src.module("vllm._version")
    version = src.evaluate(version_mod.assigns["__version__"], version_mod) if version_mod else "unknown"
    registry = src.module("vllm.model_executor.models.registry")
    rotary = rotary_mapper(src)
    chosen: dict[str, tuple[str, str]] = {}
    for table in (*_TEXT_REGISTRIES, _MULTIMODAL_REGISTRY):
        for arch, (module, cls) in src.evaluate(registry.assigns[table], registry).items():
            if table == _MULTIMODAL_REGISTRY and not arch.endswith(("ForConditionalGeneration", "ForCausalLM")):
                continue
            if _is_text_architecture(arch) or table != _MULTIMODAL_REGISTRY:
                chosen.setdefault(arch, (module, cls))
    entries = {arch: entry_for(src, arch, module, cls, rotary) for arch, (module, cls) in sorted(chosen.items())}
    return {"format": FORMAT, "vllm_version": version, "generated_by": "scripts/gen_arch_table.py",
            "architectures": entries}


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed table; exit 1 on a diff")
    parser.add_argument("--out", type=Path, default=TABLE)
    parser.add_argument("--vllm-root", type=Path, help="the `vllm` package directory to read (default: the installed)")
    args = parser.parse_args(argv)
    text = render(generate(args.vllm_root))
    if args.check:
        committed = args.out.read_text() if args.out.exists() else ""
        if committed != text:
            print(f"{args.out}: differs from the table read from the installed vLLM "
                  "(run scripts/gen_arch_table.py)", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}: {len(json.loads(text)['architectures'])} architectures", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
