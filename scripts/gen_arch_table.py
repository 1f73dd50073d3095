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

The table is stamped with the vLLM version it was read from; the drift test
(tests/test_arch_table.py) regenerates it and fails on any difference.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "layerwise_cli" / "planning" / "architectures.json"
FORMAT = 1
# Registry dicts whose architectures generate text (vLLM's `registry.py`).
_TEXT_REGISTRIES = ("_TEXT_GENERATION_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")
_MULTIMODAL_REGISTRY = "_MULTIMODAL_MODELS"
# vLLM's Transformers backend fuses at engine start what its fusers find by
# tracing the HF modules (`transformers/fusers/qkv.py`, `glu.py`).
_TRANSFORMERS_FUSIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_MOE_NAMES = ("FusedMoE", "SharedFusedMoE", "RoutedExperts", "FusedMoEFactory")
_VOCAB_NAMES = ("VocabParallelEmbedding", "ParallelLMHead")
_MAPPER_FIELDS = {"orig_to_new_prefix": "prefix", "orig_to_new_substr": "substr", "orig_to_new_suffix": "suffix",
                  "orig_to_new_regex": "regex", "orig_to_new_stacked": "stacked",
                  "orig_to_new_renaming": "renaming"}


class Unknown(Exception):
    """An expression this reader cannot evaluate statically."""


@dataclass
class ClassRef:
    module: ModuleSource
    node: ast.ClassDef

    @property
    def qualname(self) -> str:
        return f"{self.module.name}.{self.node.name}"


@dataclass
class Regex:
    pattern: str


@dataclass
class ModuleSource:
    name: str
    path: Path
    tree: ast.Module
    assigns: dict[str, ast.expr] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, attr)


class VllmSource:
    """vLLM's package sources, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root  # the `vllm` package directory
        self._modules: dict[str, ModuleSource | None] = {}

    def module(self, dotted: str) -> ModuleSource | None:
        if dotted in self._modules:
            return self._modules[dotted]
        parts = dotted.split(".")
        if parts[0] != "vllm":
            self._modules[dotted] = None
            return None
        base = self.root.joinpath(*parts[1:])
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            self._modules[dotted] = None
            return None
        tree = ast.parse(path.read_text(), str(path))
        mod = ModuleSource(dotted, path, tree)
        package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        for node in _top_level(tree.body):
            if isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        mod.assigns[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                mod.assigns[node.target.id] = node.value
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(package, node.module, node.level)
                for alias in node.names:
                    mod.imports.setdefault(alias.asname or alias.name, (source, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    mod.imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
        self._modules[dotted] = mod
        return mod

    def lookup(self, mod: ModuleSource, name: str, depth: int = 0):
        """What NAME is in MOD: a ClassRef, an evaluated value, or a module name (str)."""
        if depth > 20:
            raise Unknown(name)
        if name in mod.classes:
            return ClassRef(mod, mod.classes[name])
        if name in mod.assigns:
            return self.evaluate(mod.assigns[name], mod, depth + 1)
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return _ModuleName(source)
            other = self.module(source)
            if other is None:
                sub = self.module(f"{source}.{attr}")
                if sub is not None:
                    return _ModuleName(sub.name)
                raise Unknown(name)
            if attr not in other.classes and attr not in other.assigns and attr not in other.imports:
                sub = self.module(f"{source}.{attr}")
                if sub is not None:
                    return _ModuleName(sub.name)
            return self.lookup(other, attr, depth + 1)
        raise Unknown(name)

    def class_attr(self, ref: ClassRef, attr: str, depth: int = 0):
        """The value of class attribute ATTR on REF or its first base that sets it; raises KeyError if none."""
        for node in ref.node.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return self.evaluate(node.value, ref.module, depth + 1, owner=ref)
        for base in self.bases(ref):
            try:
                return self.class_attr(base, attr, depth + 1)
            except KeyError:
                continue
        raise KeyError(attr)

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        found = []
        for base in ref.node.bases:
            try:
                value = self.evaluate(base, ref.module)
            except Unknown:
                continue
            if isinstance(value, ClassRef):
                found.append(value)
        return found

    def mro(self, ref: ClassRef) -> list[ClassRef]:
        seen: dict[str, ClassRef] = {}
        stack = [ref]
        while stack:
            cls = stack.pop(0)
            if cls.qualname in seen:
                continue
            seen[cls.qualname] = cls
            stack.extend(self.bases(cls))
        return list(seen.values())

    def evaluate(self, node: ast.expr, mod: ModuleSource, depth: int = 0, owner: ClassRef | None = None):
        if depth > 40:
            raise Unknown("too deep")
        ev = lambda n: self.evaluate(n, mod, depth + 1, owner)  # noqa: E731
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Dict):
            out: dict = {}
            for key, value in zip(node.keys, node.values):
                if key is None:
                    out.update(ev(value))
                else:
                    out[_hashable(ev(key))] = ev(value)
            return out
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = []
            for elt in node.elts:
                if isinstance(elt, ast.Starred):
                    items.extend(ev(elt.value))
                else:
                    items.append(ev(elt))
            return items
        if isinstance(node, ast.Name):
            if owner is not None:
                # A name in a class body may be an attribute set earlier in it.
                for item in owner.node.body:
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == node.id for t in item.targets):
                        return self.evaluate(item.value, mod, depth + 1, owner)
            return self.lookup(mod, node.id, depth + 1)
        if isinstance(node, ast.Attribute):
            base = ev(node.value)
            if isinstance(base, ClassRef):
                try:
                    return self.class_attr(base, node.attr, depth + 1)
                except KeyError as exc:
                    raise Unknown(f"{base.qualname}.{node.attr}") from exc
            if isinstance(base, _ModuleName):
                other = self.module(base.name)
                if other is None:
                    raise Unknown(node.attr)
                return self.lookup(other, node.attr, depth + 1)
            raise Unknown(ast.unparse(node))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            left, right = ev(node.left), ev(node.right)
            if isinstance(left, Mapper) and isinstance(right, Mapper):
                return left.merged(right)
            if isinstance(left, dict) and isinstance(right, dict):
                return {**left, **right}
            raise Unknown(ast.unparse(node))
        if isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname == "WeightsMapper":
                if node.args:
                    raise Unknown("positional WeightsMapper")
                return Mapper({_MAPPER_FIELDS[kw.arg]: _mapper_field(kw.arg, ev(kw.value)) for kw in node.keywords})
            if fname == "compile" and node.args:
                return Regex(ev(node.args[0]))
            if fname == "dict" and not node.args:
                return {kw.arg: ev(kw.value) for kw in node.keywords}
            raise Unknown(ast.unparse(node))
        raise Unknown(ast.unparse(node))


@dataclass
class _ModuleName:
    name: str


@dataclass
class Mapper:
    """A `WeightsMapper`'s fields, as JSON-ready data."""

    fields: dict

    def merged(self, other: Mapper) -> Mapper:
        out = {key: (dict(value) if isinstance(value, dict) else list(value)) for key, value in self.fields.items()}
        for key, value in other.fields.items():
            if key in out and isinstance(value, dict):
                out[key] = {**out[key], **value}
            elif key in out:
                out[key] = out[key] + list(value)
            else:
                out[key] = value
        return Mapper(out)


def _mapper_field(arg: str, value):
    if arg == "orig_to_new_regex":
        return {(k.pattern if isinstance(k, Regex) else k): v for k, v in value.items()}
    if arg == "orig_to_new_stacked":
        return {k: [v[0], v[1]] for k, v in value.items()}
    if arg == "orig_to_new_renaming":
        raise Unknown("WeightRenaming")
    return value


def _hashable(key):
    if isinstance(key, Regex):
        return key.pattern
    if isinstance(key, list):
        return tuple(key)
    return key


def _top_level(body: list[ast.stmt]):
    """A module's statements, with those of top-level `if`/`try` blocks (platform-dependent imports) in order."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
        else:
            yield node


def _absolute(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    if level > 1:
        parts = parts[: -(level - 1)]
    return ".".join(parts + ([module] if module else []))


# -- facts from the loader code -------------------------------------------------------------------------

def _leaf(name: str) -> str:
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


def loader_facts(modules: list[ModuleSource]) -> LoaderFacts:
    """The facts of MODULES' loader code, together."""
    facts = LoaderFacts()
    for mod in modules:
        one = _module_facts(mod)
        facts.stacked.extend(one.stacked)
        for name in ("expert_names", "skip_substr", "unexpected_prefix", "unexpected_suffix", "towers",
                     "language_model"):
            getattr(facts, name).update(getattr(one, name))
        for name in ("moe", "vocab_parallel", "tied", "auto_loader", "spec_layers"):
            setattr(facts, name, getattr(facts, name) or getattr(one, name))
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
        elif isinstance(node, ast.FunctionDef) and node.name == "load_weights":
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


def _rotary_mapper(src: VllmSource) -> list[str]:
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
        if _leaf(original) != _leaf(target):
            packed.setdefault(_leaf(original), _leaf(target))
    for param, weight in facts.stacked:
        if _leaf(weight) != _leaf(param):
            packed.setdefault(_leaf(weight), _leaf(param))
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
    return {
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
    rotary = _rotary_mapper(src)
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
