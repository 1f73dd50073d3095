"""What a model's loader code fuses, skips and wraps, read from the source of the modules it is built from."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from scripts.vllm_source import ClassRef, ModuleSource, VllmSource

_MOE_NAMES = ("FusedMoE", "SharedFusedMoE", "RoutedExperts", "FusedMoEFactory")
_VOCAB_NAMES = ("VocabParallelEmbedding", "ParallelLMHead")


def leaf(name: str) -> str:
    parts = [p for p in name.split(".") if p]
    return parts[-1] if parts else name


def _str_tuples(node: ast.AST) -> list[tuple[str, str]]:
    """(param, weight) of the `(param_name, weight_name, shard_id)` tuples in a list literal."""
    found = []
    if isinstance(node, ast.List):
        for elt in node.elts:
            if (isinstance(elt, ast.Tuple) and len(elt.elts) >= 3 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elt.elts[:2])):
                found.append((elt.elts[0].value, elt.elts[1].value))
    return found


def _is_name_test(test: ast.expr) -> list[str]:
    """String constants C in tests like `C in name` (or `or` of them)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        found = [_is_name_test(v) for v in test.values]
        return [s for part in found for s in part] if all(found) else []
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.In)
            and isinstance(test.left, ast.Constant) and isinstance(test.left.value, str)
            and isinstance(test.comparators[0], ast.Name) and test.comparators[0].id in ("name", "weight_name")):
        return [test.left.value]
    return []


def _constant_replace(node: ast.AST) -> tuple[str, str] | None:
    """(OLD, NEW) of a call `x.replace("OLD", "NEW")` with two constant strings, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
            and len(node.args) == 2 and not node.keywords
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)):
        return node.args[0].value, node.args[1].value
    return None


def _guard(test: ast.expr) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(suffixes, substrings) of a test `n.endswith(S)` / `S in n`, or an `or` of them; None for any other test."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) else [test]
    suffixes, substrings = [], []
    for part in parts:
        if (isinstance(part, ast.Call) and isinstance(part.func, ast.Attribute) and part.func.attr == "endswith"
                and len(part.args) == 1 and isinstance(part.args[0], ast.Constant)
                and isinstance(part.args[0].value, str)):
            suffixes.append(part.args[0].value)
        elif (isinstance(part, ast.Compare) and len(part.ops) == 1 and isinstance(part.ops[0], ast.In)
              and isinstance(part.left, ast.Constant) and isinstance(part.left.value, str)):
            substrings.append(part.left.value)
        else:
            return None
    return tuple(suffixes), tuple(substrings)


def _renames(node: ast.AST, guards: tuple | None) -> list[tuple]:
    """Every constant `replace` under NODE, with the guards of every `if` whose body holds it (None: one unread)."""
    found = []
    if isinstance(node, ast.If):
        test = _guard(node.test)
        inner = None if guards is None or test is None else (*guards, test)
        for child in node.body:
            found += _renames(child, inner)
        for child in node.orelse:
            found += _renames(child, guards)
        return found
    pair = _constant_replace(node)
    if pair is not None:
        found.append((*pair, guards))
    for child in ast.iter_child_nodes(node):
        found += _renames(child, guards)
    return found


def _weight_helpers(tree: ast.Module) -> set[str]:
    """Methods whose stream of weights a `load_weights` of TREE hands on (`loader.load_weights(self._preprocess(
    weights))`: ERNIE-4.5-MoE).

    Such a generator renames names before the loader sees them, as a rename in `load_weights` itself does. A
    method that loads the weights itself (gpt-oss's `self._load_weights_quark(weights, ...)`, one path of
    several) is not one: its renames hold on its path only.
    """
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "load_weights":
            for outer in ast.walk(node):
                if not isinstance(outer, ast.Call):
                    continue
                for call in outer.args:
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
                            and any(isinstance(a, ast.Name) and a.id == "weights" for a in call.args)):
                        found.add(call.func.attr)
    return found - {"load_weights"}


@dataclass
class LoaderFacts:
    stacked: list[tuple[str, str]] = field(default_factory=list)
    expert_names: set[str] = field(default_factory=set)
    moe: bool = False
    vocab_parallel: bool = False
    tied: bool = False
    auto_loader: bool = False
    skip_substr: set[str] = field(default_factory=set)
    unexpected_prefix: set[str] = field(default_factory=set)
    unexpected_suffix: set[str] = field(default_factory=set)
    spec_layers: bool = False
    towers: set[str] = field(default_factory=set)
    language_model: set[str] = field(default_factory=set)
    # `name.replace(OLD, NEW)` with two constant strings in a `load_weights`: names the loader renames itself,
    # each with the tests of every `if` it sits in, when each is `name.endswith(S)` / `S in name` (or `or`s of
    # them): (old, new, ((suffixes, substrings), ...)), all of which must hold; None when one was not read.
    renames: list[tuple] = field(default_factory=list)
    # The model builds its mapper from its config and drops the K/V of its KV-shared layers with it (Gemma 4's
    # `self.hf_to_vllm_mapper = _gemma4_layer_weights_mapper(config)`).
    kv_shared: bool = False


def loader_facts(modules: list[ModuleSource]) -> LoaderFacts:
    """The facts of MODULES' loader code, together."""
    facts = LoaderFacts()
    for mod in modules:
        one = _module_facts(mod)
        facts.stacked.extend(one.stacked)
        for name in ("expert_names", "skip_substr", "unexpected_prefix", "unexpected_suffix", "towers",
                     "language_model"):
            getattr(facts, name).update(getattr(one, name))
        for name in ("moe", "vocab_parallel", "tied", "auto_loader", "spec_layers", "kv_shared"):
            setattr(facts, name, getattr(facts, name) or getattr(one, name))
        facts.renames.extend(pair for pair in one.renames if pair not in facts.renames)
    return facts


_FACTS: dict[str, LoaderFacts] = {}


def _module_facts(mod: ModuleSource) -> LoaderFacts:
    if mod.name in _FACTS:
        return _FACTS[mod.name]
    facts = _FACTS[mod.name] = LoaderFacts()
    text = mod.path.read_text()
    facts.moe |= any(name in text for name in _MOE_NAMES)
    facts.vocab_parallel |= any(name in text for name in _VOCAB_NAMES)
    facts.tied |= "tie_word_embeddings" in text
    facts.spec_layers |= "get_spec_layer_idx_from_weight_name" in text
    facts.kv_shared |= "num_kv_shared_layers" in text and bool(
        re.search(r"self\.hf_to_vllm_mapper = \w+\(config\)", text))
    helpers = _weight_helpers(mod.tree)
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and "mapping" in t.id and "expert" not in t.id for t in node.targets):
            facts.stacked.extend(_str_tuples(node.value))
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname.endswith("make_expert_params_mapping"):
                for kw in node.keywords:
                    if (kw.arg and kw.arg.startswith("ckpt_") and isinstance(kw.value, ast.Constant)
                            and isinstance(kw.value.value, str)):
                        facts.expert_names.add(kw.value.value)
            elif fname == "AutoWeightsLoader":
                facts.auto_loader = True
                for kw in node.keywords:
                    target = {"ignore_unexpected_prefixes": facts.unexpected_prefix,
                              "ignore_unexpected_suffixes": facts.unexpected_suffix}.get(kw.arg or "")
                    if target is not None and isinstance(kw.value, (ast.List, ast.Tuple)):
                        target.update(e.value for e in kw.value.elts if isinstance(e, ast.Constant))
            elif fname == "extend" and node.args:
                facts.stacked.extend(_str_tuples(node.args[0]))
        elif isinstance(node, ast.FunctionDef) and node.name in helpers:
            for rename in _renames(node, ()):
                if rename not in facts.renames:
                    facts.renames.append(rename)
        if isinstance(node, ast.FunctionDef) and node.name == "load_weights":
            for rename in _renames(node, ()):
                if rename not in facts.renames:
                    facts.renames.append(rename)
            # `if "rotary_emb.inv_freq" in name: continue` directly in the loop over the weights
            # (not in the inner loops over the stacked mappings, where `continue` tries the next one).
            for loop in ast.walk(node):
                if isinstance(loop, ast.For) and "weights" in ast.unparse(loop.iter):
                    for sub in loop.body:
                        if isinstance(sub, ast.If) and sub.body and isinstance(sub.body[0], ast.Continue):
                            facts.skip_substr.update(_is_name_test(sub.test))
        elif isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
                    bucket = {"_mark_tower_model": facts.towers,
                              "_mark_language_model": facts.language_model}.get(call.func.attr)
                    if bucket is not None:
                        for sub in ast.walk(node):
                            if (isinstance(sub, ast.Assign) and isinstance(sub.targets[0], ast.Attribute)
                                    and isinstance(sub.targets[0].value, ast.Name)
                                    and sub.targets[0].value.id == "self"):
                                bucket.add(sub.targets[0].attr)
    return facts


def related_modules(src: VllmSource, ref: ClassRef) -> list[ModuleSource]:
    """The class's module, its bases' modules, and the modules their inner models come from."""
    mods: dict[str, ModuleSource] = {}
    for cls in src.mro(ref):
        mods.setdefault(cls.module.name, cls.module)
    for mod in list(mods.values()):
        for local, (source, attr) in mod.imports.items():
            if attr and (local.endswith(("Model", "DecoderLayer", "MoE", "MoeBlock")) or "Model" in local):
                other = src.module(source)
                if other is not None and source.startswith("vllm.model") and attr in other.classes:
                    mods.setdefault(other.name, other)
    return [mods[name] for name in sorted(mods)]


def _counts_a_derived_buffer(cls: ast.ClassDef) -> bool:
    """Whether CLS's `__init__` makes parameters and registers a non-persistent buffer beside them."""
    for init in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
        calls = [n for n in ast.walk(init) if isinstance(n, ast.Call)]
        derived = any(isinstance(c.func, ast.Attribute) and c.func.attr == "register_buffer" and any(
            k.arg == "persistent" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in c.keywords) for c in calls)
        parameters = any((isinstance(c.func, ast.Attribute) and c.func.attr == "Parameter")
                         or (isinstance(c.func, ast.Name) and c.func.id == "Parameter") for c in calls)
        if derived and parameters:
            return True
    return False


def held_modules(modules: list[ModuleSource]) -> set[str]:
    """Attribute names (`self.router = Gemma4Router(...)`) of modules vLLM's reload holds to the end of a stream.

    Such a module owns parameters and a non-persistent buffer (derived, never in a checkpoint: Gemma 4's
    router and its `root_size`). vLLM's reload counts every tensor of a module towards its completion
    (`get_layer_size`), the buffer included, so the checkpoint never completes it: vLLM processes it at the end.
    """
    classes = {cls.name for mod in modules for cls in ast.walk(mod.tree)
               if isinstance(cls, ast.ClassDef) and _counts_a_derived_buffer(cls)}
    found = set()
    for mod in modules:
        for node in ast.walk(mod.tree):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                    and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"
                    and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id in classes):
                found.add(node.targets[0].attr)
    return found
