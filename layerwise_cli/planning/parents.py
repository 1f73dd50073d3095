"""Map checkpoint tensors to the engine modules ("parent layers") that consume them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.planning import arch_table
from layerwise_cli.planning.completion_rule import DIRECT_LOAD_TENSORS
from layerwise_cli.planning.skip_rules import SkipRules, is_output_head, skip_rules_for
from layerwise_cli.planning.vllm_mapping import fusions_from_vllm, model_class_if_installed

# The fusions vLLM applies in almost every decoder model: the guess for an
# architecture outside the table.
_USUAL_FUSIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                  "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

_EXPERT_RE = re.compile(r"^(?P<head>.*\.experts)\.\d+\.")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# What Gemma 4's loader drops in a KV-shared layer (`_gemma4_layer_weights_mapper`'s `orig_to_new_substr`).
_KV_SHARED_DROPS = re.compile(r"\.self_attn\.(?:k_proj|v_proj|k_norm)\.")


@dataclass(frozen=True)
class ParentLayer:
    """Where a tensor goes: the engine module name and its place in model order."""

    name: str
    # (section, decoder layer index): 0 embeddings, 1 decoder layers, 2 final
    # norm and other modules after the layers, 3 output head, 4 the parts a
    # wrapped text model carries beside it (vision towers, projectors).
    order_key: tuple[int, int]


@dataclass(frozen=True)
class LayerMapping:
    """A rule set mapping checkpoint tensor names to parent layers.

    `kind` says where the rules came from: `table` (layerwise's architecture
    table, read from vLLM's model sources: `arch_table`), `vllm` (read from the
    installed vLLM's model class), `guess` (an architecture in no table: one
    parent layer per module with the fusions vLLM applies almost everywhere) or
    `generic` (no architecture at all: grouped by the outermost layer index).
    """

    kind: str
    architecture: str | None
    packed: dict[str, str] = field(default_factory=dict)
    fused_experts: bool = True
    tie_word_embeddings: bool = False
    # vLLM's skip rules for the architecture (None: the package's rules, from the fields above).
    skips: SkipRules | None = None
    # Checkpoint prefixes of the parts a wrapped text model carries beside it (vision towers, projectors).
    towers: tuple[str, ...] = ()
    # Where the table entry came from: the vLLM class, its backend and the vLLM version.
    source_class: str | None = None
    backend: str = "vllm"
    vllm_version: str | None = None
    # The renames the model's own `load_weights` applies (`name.replace(OLD, NEW)`, read from its source into the
    # table), in order, as (OLD, NEW, WHEN). WHEN: the tests around it, all of which must hold, each a
    # (suffixes, substrings) pair of which one must match; None when a test was not read: then a worker tries
    # the rename only for a tensor whose module its engine lacks (`renamed_candidates`).
    renames: tuple[tuple[str, str, tuple | None], ...] = ()
    # The first KV-shared decoder layer (Gemma 4's `num_kv_shared_layers`), where the model's loader builds its
    # mapper from the config (`_gemma4_layer_weights_mapper`): from there on a layer's attention has `q_proj`
    # alone (not fused) and the loader drops the checkpoint's `k_proj`, `v_proj` and `k_norm`. None: no such rule.
    kv_shared_from: int | None = None
    # Leaf names of modules vLLM completes only at the end of the stream: they own parameters and a derived
    # (non-persistent) buffer its reload counts but no checkpoint fills (Gemma 4's `router`; the table's
    # `held_modules`).
    held_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.skips is None:
            object.__setattr__(self, "skips", skip_rules_for(self.architecture, None,
                                                             tied=self.tie_word_embeddings))

    def skip_reason(self, tensor_name: str) -> str | None:
        """Why vLLM's loader skips a checkpoint tensor on purpose (see `skip_rules`), or None if it loads it."""
        assert self.skips is not None
        if self.backend == "transformers" and tensor_name.endswith("lm_head.bias"):
            # That backend's `load_weights` takes a head's bias before its tied-head skip: tied or not, it loads it.
            return None
        if self._kv_shared(tensor_name) and _KV_SHARED_DROPS.search(tensor_name):
            return (f"{self.architecture}'s loader drops the K/V projections of its KV-shared layers (from layer "
                    f"{self.kv_shared_from}: they read an earlier layer's KV cache)")
        return self.skips.reason(tensor_name)

    def _kv_shared(self, name: str) -> bool:
        if self.kv_shared_from is None:
            return False
        match = _LAYER_RE.search(name)
        return match is not None and int(match.group(1)) >= self.kv_shared_from

    @property
    def description(self) -> str:
        arch = self.architecture or "unknown architecture"
        if self.kind == "table":
            text = f"{arch}: layerwise's architecture table (vLLM {self.vllm_version}, {self.source_class})"
            if self.backend == "transformers":
                text += ("; vLLM runs it on its Transformers backend, which fuses q/k/v into qkv_proj and "
                         "gate/up into gate_up_proj when it builds the engine")
            if self.towers:
                text += (f"; the text model is planned, and {', '.join(self.towers)} (not text) are planned as one "
                         "parent per module: vLLM reloads them unless the engine runs text-only")
            return text
        return {
            "vllm": f"{arch}: read from the installed vLLM's model class",
            "guess": f"{arch}: not in layerwise's table (vLLM {self.vllm_version}): a guess, one parent layer "
                     "per module with the fusions vLLM applies almost everywhere (q/k/v -> qkv_proj, "
                     "gate/up -> gate_up_proj, a layer's experts), as its Transformers backend forms them for an "
                     "architecture outside its registry",
            "generic": f"{arch}: generic fallback, grouped by outermost layer index (fusions unknown)",
        }[self.kind]

    def loaded_directly(self, tensor_name: str) -> bool:
        """Whether vLLM's loader writes TENSOR_NAME straight into the engine's tensor, never buffering it.

        vLLM's reload wraps no loader of the tensors named in its `SKIP_LOAD_TENSORS` (`DIRECT_LOAD_TENSORS`:
        an MoE gate's `e_score_correction_bias`), and its Transformers backend gives `lm_head` a new bias and
        loads it with the plain loader on every load (`TransformersForCausalLM.load_weights`).
        """
        name = self.renamed(tensor_name)
        return (name.rpartition(".")[2] in DIRECT_LOAD_TENSORS
                or (self.backend == "transformers" and name.endswith("lm_head.bias")))

    def uncounted_reason(self, tensor_name: str) -> str | None:
        """Why vLLM's count of TENSOR_NAME's parent layer never completes, when the tensor or its layer says why.

        The Transformers backend's `lm_head.bias` is loaded outside the count, while the count still expects
        its elements: vLLM holds `lm_head` to the end of the stream, padded vocabulary or not. A module of
        `held_modules` counts a derived buffer no checkpoint fills.
        """
        if self.backend == "transformers" and self.renamed(tensor_name).endswith("lm_head.bias"):
            return "its bias is loaded outside vLLM's count (vLLM's Transformers backend registers it anew)"
        parent = self.parent_of(tensor_name)
        if parent is not None and parent.name.rpartition(".")[2] in self.held_modules:
            return "vLLM counts a derived buffer of it that no checkpoint fills"
        return None

    def for_tensors(self, tensor_names: Iterable[str]) -> LayerMapping:
        """This mapping for a checkpoint of TENSOR_NAMES: on the Transformers backend, only the fusions it can form.

        vLLM's Transformers backend fuses at engine start what its fusers find in the model's forward (q/k/v
        projections, a GLU's gate and up), so a model without a gate (Arcee's and Jais2's `up_proj` alone: a
        non-gated MLP) keeps its modules. A fusion is kept when the checkpoint holds each of its parts.
        """
        if self.backend != "transformers" or not self.packed:
            return self
        leaves = {name.rpartition(".")[0].rpartition(".")[2] for name in tensor_names}
        parts: dict[str, set[str]] = {}
        for part, fused in self.packed.items():
            parts.setdefault(fused, set()).add(part)
        kept = {part: fused for part, fused in self.packed.items() if parts[fused] <= leaves}
        return self if kept == self.packed else replace(self, packed=kept)

    def for_engine(self, module_names: Iterable[str]) -> LayerMapping:
        """This mapping for an engine of MODULE_NAMES: on the Transformers backend, only the fusions it formed.

        That backend's fusers fuse only the modules they recognise in the model's forward, and name what they
        merge themselves: BioGPT keeps its `q_proj` and gets `merged_proj_6_k_proj_6_v_proj` for `k_proj` and
        `v_proj` (`MergedColumnParallelFuser.merged_name`). A fusion whose fused module the engine lacks is
        dropped, and each merged module the engine has is planned as one parent of the parts its name lists.
        """
        if self.backend != "transformers":
            return self
        leaves = {name.rpartition(".")[2] for name in module_names}
        kept = {part: fused for part, fused in self.packed.items() if fused in leaves}
        for leaf in sorted(leaves):
            kept.update({part: leaf for part in merged_parts(leaf)})
        return self if kept == self.packed else replace(self, packed=kept)

    def renamed_candidates(self, tensor_name: str) -> list[str]:
        """TENSOR_NAME under each rename of the loader whose test was not read, where OLD occurs in it."""
        return [tensor_name.replace(old, new) for old, new, when in self.renames if when is None and old in tensor_name]

    def renamed(self, tensor_name: str) -> str:
        """TENSOR_NAME as the model's loader renames it where the tests around its renames hold."""
        for old, new, when in self.renames:
            if when is not None and old in tensor_name and all(
                    any(tensor_name.endswith(s) for s in suffixes) or any(s in tensor_name for s in substrings)
                    for suffixes, substrings in when):
                tensor_name = tensor_name.replace(old, new)
        return tensor_name

    def parent_of(self, tensor_name: str) -> ParentLayer | None:
        """Return the parent layer of a checkpoint tensor, or None if vLLM skips it.

        Args:
            tensor_name: the name as stored in the checkpoint.

        Returns:
            The parent layer, or None for tensors vLLM's loader skips on
            purpose (`skip_reason`: rotary caches, names the model's name
            mapper drops, a tied `lm_head`, MTP layers).
        """
        if self.skip_reason(tensor_name) is not None:
            return None
        tensor_name = self.renamed(tensor_name)
        module, _, _param = tensor_name.rpartition(".")
        if not module:
            module = tensor_name
        if self.fused_experts:
            match = _EXPERT_RE.match(tensor_name)
            if match:
                module = match.group("head")
        head, _, leaf = module.rpartition(".")
        if leaf in self.packed and not (self._kv_shared(module + ".") and leaf == "q_proj"):
            module = f"{head}.{self.packed[leaf]}" if head else self.packed[leaf]
        tower = next((prefix for prefix in self.towers if tensor_name.startswith(prefix)), None)
        if self.kind == "generic":
            # Fusions are unknown, and a fused module never spans two decoder
            # layers: a whole decoder layer is the one safe unit to complete.
            match = _LAYER_RE.search(module)
            if match:
                module = module[: match.end() - 1]
        if tower is not None:
            # After the text model, in the tower's own layer order.
            match = _LAYER_RE.search(module + ".")
            return ParentLayer(module, (4, int(match.group(1)) if match else -1))
        return ParentLayer(module, _order_key(module))


def merged_parts(leaf: str) -> tuple[str, ...]:
    """The modules vLLM's Transformers backend merged into LEAF (`merged_proj_6_k_proj_6_v_proj`); () if none.

    The name is `merged_proj_` and, per part, its length and its name (`MergedColumnParallelFuser.merged_name`).
    """
    prefix = "merged_proj_"
    if not leaf.startswith(prefix):
        return ()
    rest, parts = leaf[len(prefix):], []
    while rest:
        length, sep, rest = rest.partition("_")
        if not length.isdigit() or not sep or len(rest) < int(length):
            return ()
        parts.append(rest[:int(length)])
        rest = rest[int(length):]
        if rest and not rest.startswith("_"):
            return ()
        rest = rest[1:]
    return tuple(parts)


def _order_key(module: str) -> tuple[int, int]:
    match = _LAYER_RE.search(module + ".")
    if match:
        return (1, int(match.group(1)))
    if is_output_head(module):
        return (3, 0)
    leaf = module.split(".")[-1]
    if "embed" in leaf or leaf in {"wte", "wpe"}:
        return (0, 0)
    return (2, 0)


def mapping_for_config(config: dict | None, prefer: str = "auto", *, model_cls: type | None = None) -> LayerMapping:
    """Choose the mapping for a checkpoint's `config.json`.

    Args:
        config: the parsed `config.json`, or None when the checkpoint has none.
        prefer: `auto` (the table for the architectures it holds, unless the
            installed vLLM is another version than the table's; else vLLM's
            model class when vLLM is installed; else a guess for a named
            architecture, generic without one), `table`, `vllm` or `generic`.
        model_cls: vLLM's model class for the architecture (in a worker, the
            engine's own): its skip rules are read from it. None: read from the
            class only when the mapping itself comes from vLLM; else the
            table's and the package's skip rules.

    Returns:
        The mapping to plan with; its `kind` says which was used.
    """
    if prefer not in {"auto", "table", "vllm", "generic"}:
        raise UsageError(f"unknown mapping {prefer!r}: use auto, table, vllm or generic")
    config = config if isinstance(config, dict) else {}
    archs = config.get("architectures")
    # config.json is user data: take the first architecture only if it is a name.
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    text_config = config.get("text_config")
    text_config = text_config if isinstance(text_config, dict) else {}
    tied = bool(config.get("tie_word_embeddings", False) or text_config.get("tie_word_embeddings", False))

    def skips(cls: type | None, entry: dict | None = None) -> SkipRules:
        return skip_rules_for(arch, config, model_cls=cls, tied=tied, table_entry=entry)

    entry = arch_table.entry(arch)
    # The table is read from one vLLM version; a different installed vLLM answers for itself.
    installed = arch_table.installed_vllm_version() if prefer == "auto" and entry is not None else None
    stale = installed is not None and arch_table.table_for(installed) is None
    if entry is not None and (prefer == "table" or (prefer == "auto" and not stale)):
        return mapping_from_entry(arch, entry, tied, skips(model_cls, entry), config)
    if prefer in {"auto", "vllm"} and arch:
        found = fusions_from_vllm(arch, required=prefer == "vllm")
        if found is not None:
            packed, fused_experts = found
            return LayerMapping("vllm", arch, packed, fused_experts, tied,
                                skips(model_cls or model_class_if_installed(arch), entry),
                                renames=table_renames(entry))
        if entry is not None:  # vLLM could not import the class: the table still knows it
            return mapping_from_entry(arch, entry, tied, skips(model_cls, entry), config)
    if prefer in {"table", "vllm"}:
        if arch is None:
            raise LayerwiseError(f"--mapping {prefer} needs config.json's architectures; the checkpoint has none")
        raise LayerwiseError(f"architecture {arch!r} is not in layerwise's table (try --mapping auto)")
    if arch is not None and prefer == "auto":
        # vLLM runs an architecture outside its registry on its Transformers backend (when `transformers` has it):
        # that backend's fusions, and its rules for what a checkpoint lacks (`for_tensors`) and `lm_head.bias`.
        return LayerMapping("guess", arch, dict(_USUAL_FUSIONS), True, tied, skips(model_cls),
                            vllm_version=arch_table.table_version(), backend="transformers")
    return LayerMapping("generic", arch, {}, True, tied, skips(model_cls))


def mapping_from_entry(architecture: str, entry: dict, tied: bool, skips: SkipRules,
                       config: dict | None = None) -> LayerMapping:
    """The mapping one entry of the architecture table describes (see `arch_table`), with its skip rules."""
    wrapped = entry.get("wrapped") or {}
    return LayerMapping(
        "table", architecture, dict(entry.get("packed") or {}), bool(entry.get("experts")),
        skips.tied_head, skips, tuple(wrapped.get("tower_prefixes") or ()),
        entry.get("class"), entry.get("backend", "vllm"), arch_table.table_version(),
        table_renames(entry), kv_shared_from(entry, config), tuple(entry.get("held_modules") or ()),
    )


def kv_shared_from(entry: dict, config: dict | None) -> int | None:
    """The first KV-shared layer where ENTRY's loader drops their K/V (`kv_shared_layers`), from CONFIG; or None."""
    if not entry.get("kv_shared_layers") or not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    shared, layers = text.get("num_kv_shared_layers"), text.get("num_hidden_layers")
    if not isinstance(shared, int) or not isinstance(layers, int) or shared <= 0:
        return None
    return layers - shared


def table_renames(entry: dict | None) -> tuple[tuple[str, str, tuple | None], ...]:
    """An architecture table entry's `renames`, as `LayerMapping.renames` holds them."""
    found = []
    for rename in (entry or {}).get("renames") or ():
        when = rename.get("when")
        found.append((rename["old"], rename["new"], None if when is None else tuple(
            (tuple(test.get("suffix") or ()), tuple(test.get("substr") or ())) for test in when)))
    return tuple(found)
