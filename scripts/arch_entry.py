"""One architecture's table entry: its fusions, weights mapper, experts, vocabulary padding and skipped weights."""

from __future__ import annotations

import ast

from scripts.loader_facts import held_modules, leaf, loader_facts, related_modules
from scripts.vllm_source import ClassRef, Mapper, Unknown, VllmSource

# vLLM's Transformers backend fuses at engine start what its fusers find by
# tracing the HF modules (`transformers/fusers/qkv.py`, `glu.py`).
_TRANSFORMERS_FUSIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def rotary_mapper(src: VllmSource) -> list[str]:
    """The substrings `AutoWeightsLoader` always drops (`REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER`)."""
    utils = src.module("vllm.model_executor.models.utils")
    loader = ClassRef(utils, utils.classes["AutoWeightsLoader"])
    mapper = src.class_attr(loader, "REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER")
    return sorted(k for k, v in mapper.fields.get("substr", {}).items() if v is None)


def entry_for(src: VllmSource, architecture: str, module: str, class_name: str, rotary: list[str]) -> dict:
    dotted = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    mod = src.module(dotted)
    try:
        ref = src.lookup(mod, class_name) if mod is not None else None
    except Unknown:
        ref = None
    if not isinstance(ref, ClassRef):
        return {"class": f"{dotted}.{class_name}", "error": "class source not found"}
    notes: list[str] = []
    backend = "transformers" if module == "transformers" else "vllm"
    packed_mapping: dict = {}
    mapper: dict = {}
    try:
        packed_mapping = dict(src.class_attr(ref, "packed_modules_mapping"))
    except KeyError:
        pass
    except Unknown as exc:
        notes.append(f"packed_modules_mapping not read: {exc}")
    try:
        value = src.class_attr(ref, "hf_to_vllm_mapper")
        mapper = value.fields if isinstance(value, Mapper) else {}
    except KeyError:
        pass
    except Unknown as exc:
        notes.append(f"hf_to_vllm_mapper not read: {exc}")
    # Entries set on the instance (`self.packed_modules_mapping["qkv_proj"] = [...]`, DeepSeek).
    for cls in src.mro(ref):
        for node in ast.walk(cls.node):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                    and ast.unparse(node.targets[0].value) == "self.packed_modules_mapping"):
                try:
                    packed_mapping.setdefault(src.evaluate(node.targets[0].slice, cls.module),
                                              src.evaluate(node.value, cls.module))
                except Unknown:
                    notes.append("a conditional packed_modules_mapping entry not read")
    modules = related_modules(src, ref)
    facts = loader_facts(modules)
    packed: dict[str, str] = {}
    if backend == "transformers":
        packed.update(_TRANSFORMERS_FUSIONS)
    for fused, parts in sorted(packed_mapping.items()):
        for part in parts:
            if part != fused:
                packed.setdefault(part, fused)
    for original, (target, _shard) in sorted(mapper.get("stacked", {}).items()):
        if leaf(original) != leaf(target):
            packed.setdefault(leaf(original), leaf(target))
    for param, weight in facts.stacked:
        if leaf(weight) != leaf(param):
            packed.setdefault(leaf(weight), leaf(param))
    moe = facts.moe or (backend == "transformers" and class_name.startswith("TransformersMoE"))
    skipped = {
        "substr": sorted(set(rotary) | facts.skip_substr) if facts.auto_loader else sorted(facts.skip_substr),
        "mapper_drops": {kind: sorted(k for k, v in mapper.get(kind, {}).items() if v is None)
                         for kind in ("prefix", "substr", "suffix", "regex")
                         if any(v is None for v in mapper.get(kind, {}).values())},
        "if_unexpected_prefix": sorted(facts.unexpected_prefix),
        "if_unexpected_suffix": sorted(facts.unexpected_suffix | ({".bias"} if facts.auto_loader else set())),
        "tied_head": facts.tied,
        "mtp_layers": facts.spec_layers or backend == "transformers",
    }
    wrapped = None
    prefixes = mapper.get("prefix", {})  # a dict here: the pairs are written below
    text_targets = sorted({v for v in prefixes.values() if isinstance(v, str) and "language_model" in v})
    if text_targets or facts.towers:
        wrapped = {
            "text": sorted(k for k, v in prefixes.items() if isinstance(v, str) and "language_model" in v),
            "towers": sorted(facts.towers),
            "tower_prefixes": sorted(k for k, v in prefixes.items() if isinstance(v, str)
                                     and "language_model" not in v and k.startswith("model.") and k != "model."),
        }
    entry = {
        "class": f"{dotted}.{class_name}",
        "backend": backend,
        "packed": dict(sorted(packed.items())),
        "packed_modules_mapping": {k: list(v) for k, v in sorted(packed_mapping.items())},
        # Pairs, not objects: vLLM applies a mapper's entries in their order.
        "mapper": {k: ([[a, b] for a, b in v.items()] if isinstance(v, dict) else v) for k, v in mapper.items()},
        "experts": {"fused": True, "checkpoint_names": sorted(facts.expert_names)} if moe else None,
        "vocab_padding": 64 if facts.vocab_parallel or backend == "transformers" else None,
        "skipped": skipped,
        "wrapped": wrapped,
        "notes": notes,
    }
    held = held_modules(modules)
    if held:
        # Modules vLLM's reload completes only at the end of the stream (see `loader_facts.held_modules`).
        entry["held_modules"] = sorted(held)
    if facts.kv_shared:
        # `kv_shared_from` in the planner: vLLM's mapper of the K/V a KV-shared layer drops (see loader_facts).
        entry["kv_shared_layers"] = True
    renames = list(facts.renames) + [r for r in inner_mapper_renames(src, ref, mapper) if r not in facts.renames]
    # One name replaced two ways under the same tests is a split into two tensors (TeleChat2's `key_value`), no
    # rename: the planner cannot follow it.
    splits = {(old, repr(guards)) for old, new, guards in renames
              if any(o == old and repr(g) == repr(guards) and n != new for o, n, g in renames)}
    renames = [r for r in renames if (r[0], repr(r[2])) not in splits]
    if renames:
        # In the order the loader's source has them. `when`: the tests of the `if`s around it, all of which must
        # hold (each: the name ends with one of `suffix` or holds one of `substr`); a rename with a test that
        # was not read (`when` null) applies only to a name whose module the engine lacks (the worker tries it).
        entry["renames"] = [{"old": old, "new": new, "when": None if guards is None else [
            {"suffix": list(suffixes), "substr": list(substrings)} for suffixes, substrings in guards]}
            for old, new, guards in renames]
    return entry



def inner_models(src: VllmSource, ref: ClassRef) -> list[ClassRef]:
    """The classes REF's `__init__` (or a base's) builds as `self.NAME = Class(...)`: the inner model and the rest."""
    found: dict[str, ClassRef] = {}
    for cls in src.mro(ref):
        for node in cls.node.body:
            if not (isinstance(node, ast.FunctionDef) and node.name == "__init__"):
                continue
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Assign) and isinstance(sub.targets[0], ast.Attribute)
                        and isinstance(sub.targets[0].value, ast.Name) and sub.targets[0].value.id == "self"
                        and isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name)):
                    try:
                        inner = src.lookup(cls.module, sub.value.func.id)
                    except Unknown:
                        continue
                    if isinstance(inner, ClassRef):
                        found.setdefault(inner.qualname, inner)
    return list(found.values())


def inner_mapper_renames(src: VllmSource, ref: ClassRef, outer: dict) -> list[tuple]:
    """The suffix and substring renames of an inner model's own `hf_to_vllm_mapper` (Granite MoE's `GraniteMoeModel`).

    Its `load_weights` applies them to the names below its prefix; a suffix or a substring is the same rename on
    the checkpoint's full name, so each is a rename guarded by its own suffix or substring (`when`).
    """
    found = []
    for inner in inner_models(src, ref):
        try:
            value = src.class_attr(inner, "hf_to_vllm_mapper")
        except (KeyError, Unknown):
            continue
        if not isinstance(value, Mapper) or value.fields == outer:
            continue
        for kind, guard in (("suffix", lambda old: ((old,), ())), ("substr", lambda old: ((), (old,)))):
            for old, new in (value.fields.get(kind) or {}).items():
                if isinstance(new, str) and old != new:
                    found.append((old, new, (guard(old),)))
    return found
