"""Map checkpoint tensors to the engine modules ("parent layers") that consume them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

# The fusions vLLM applies in almost every decoder model: the guess for an
# architecture outside the table.
_USUAL_FUSIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                  "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
# Buffers some exporters write that vLLM's loaders drop (AutoWeightsLoader's
# REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER); the table lists them per architecture.
_ROTARY_BUFFERS = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached",
                   "rotary_emb.sin_cached")

_EXPERT_RE = re.compile(r"^(?P<head>.*\.experts)\.\d+\.")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


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
    # Substrings of names vLLM's loader drops (rotary caches, ...).
    skip_substr: tuple[str, ...] = _ROTARY_BUFFERS
    # (`prefix`|`substr`|`suffix`|`regex`, pattern): names the model's `hf_to_vllm_mapper` drops.
    drops: tuple[tuple[str, str], ...] = ()
    # Checkpoint prefixes of the parts a wrapped text model carries beside it (vision towers, projectors).
    towers: tuple[str, ...] = ()
    # Where the table entry came from: the vLLM class, its backend and the vLLM version.
    source_class: str | None = None
    backend: str = "vllm"
    vllm_version: str | None = None

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
                     "gate/up -> gate_up_proj, a layer's experts)",
            "generic": f"{arch}: generic fallback, grouped by outermost layer index (fusions unknown)",
        }[self.kind]

    def skips(self, tensor_name: str) -> bool:
        """True when vLLM's loader for this architecture drops TENSOR_NAME (never loaded, never buffered)."""
        if any(part in tensor_name for part in self.skip_substr):
            return True
        for kind, pattern in self.drops:
            if ((kind == "prefix" and tensor_name.startswith(pattern))
                    or (kind == "substr" and pattern in tensor_name)
                    or (kind == "suffix" and tensor_name.endswith(pattern))
                    or (kind == "regex" and _regex(pattern).search(tensor_name))):
                return True
        return False

    def parent_of(self, tensor_name: str) -> ParentLayer | None:
        """Return the parent layer of a checkpoint tensor, or None if vLLM skips it.

        Args:
            tensor_name: the name as stored in the checkpoint.

        Returns:
            The parent layer, or None for tensors the engine does not load
            (rotary caches, names the model's name mapper drops, `lm_head` of
            a model with tied embeddings).
        """
        if self.skips(tensor_name):
            return None
        module, _, _param = tensor_name.rpartition(".")
        if not module:
            module = tensor_name
        if self.fused_experts:
            match = _EXPERT_RE.match(tensor_name)
            if match:
                module = match.group("head")
        head, _, leaf = module.rpartition(".")
        if leaf in self.packed:
            module = f"{head}.{self.packed[leaf]}" if head else self.packed[leaf]
        tower = next((prefix for prefix in self.towers if tensor_name.startswith(prefix)), None)
        if self.tie_word_embeddings and tower is None and _is_head(module):
            return None
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


@cache
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _is_head(module: str) -> bool:
    return module.split(".")[-1] in {"lm_head", "output", "embed_out"} and "layers." not in module


def _order_key(module: str) -> tuple[int, int]:
    match = _LAYER_RE.search(module + ".")
    if match:
        return (1, int(match.group(1)))
    if _is_head(module):
        return (3, 0)
    leaf = module.split(".")[-1]
    if "embed" in leaf or leaf in {"wte", "wpe"}:
        return (0, 0)
    return (2, 0)


def mapping_for_config(config: dict | None, prefer: str = "auto") -> LayerMapping:
    """Choose the mapping for a checkpoint's `config.json`.

    Args:
        config: the parsed `config.json`, or None when the checkpoint has none.
        prefer: `auto` (the table for the architectures it holds, unless the
            installed vLLM is another version than the table's; else vLLM's
            model class when vLLM is installed; else a guess for a named
            architecture, generic without one), `table`, `vllm` or `generic`.

    Returns:
        The mapping to plan with; its `kind` says which was used.
    """
    if prefer not in {"auto", "table", "vllm", "generic"}:
        from layerwise_cli.errors import UsageError

        raise UsageError(f"unknown mapping {prefer!r}: use auto, table, vllm or generic")
    config = config if isinstance(config, dict) else {}
    archs = config.get("architectures")
    # config.json is user data: take the first architecture only if it is a name.
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    text_config = config.get("text_config")
    text_config = text_config if isinstance(text_config, dict) else {}
    tied = bool(config.get("tie_word_embeddings", False) or text_config.get("tie_word_embeddings", False))
    from layerwise_cli.planning import arch_table

    entry = arch_table.entry(arch)
    # The table is read from one vLLM version; a different installed vLLM answers for itself.
    installed = arch_table.installed_vllm_version() if prefer == "auto" and entry is not None else None
    stale = installed is not None and installed != arch_table.table_version()
    if entry is not None and (prefer == "table" or (prefer == "auto" and not stale)):
        return mapping_from_entry(arch, entry, tied)
    if prefer in {"auto", "vllm"} and arch:
        from layerwise_cli.planning.vllm_mapping import fusions_from_vllm

        found = fusions_from_vllm(arch, required=prefer == "vllm")
        if found is not None:
            packed, fused_experts = found
            return LayerMapping("vllm", arch, packed, fused_experts, tied)
        if entry is not None:  # vLLM could not import the class: the table still knows it
            return mapping_from_entry(arch, entry, tied)
    if prefer in {"table", "vllm"}:
        from layerwise_cli.errors import LayerwiseError

        if arch is None:
            raise LayerwiseError(f"--mapping {prefer} needs config.json's architectures; the checkpoint has none")
        raise LayerwiseError(f"architecture {arch!r} is not in layerwise's table (try --mapping auto)")
    if arch is not None and prefer == "auto":
        return LayerMapping("guess", arch, dict(_USUAL_FUSIONS), True, tied,
                            vllm_version=arch_table.table_version())
    return LayerMapping("generic", arch, {}, True, tied)


def mapping_from_entry(architecture: str, entry: dict, tied: bool) -> LayerMapping:
    """The mapping one entry of the architecture table describes (see `arch_table`)."""
    skipped = entry.get("skipped") or {}
    drops = tuple((kind, pattern) for kind, patterns in sorted((skipped.get("mapper_drops") or {}).items())
                  for pattern in patterns)
    wrapped = entry.get("wrapped") or {}
    from layerwise_cli.planning import arch_table

    return LayerMapping(
        "table", architecture, dict(entry.get("packed") or {}), bool(entry.get("experts")),
        tied and bool(skipped.get("tied_head", True)), tuple(skipped.get("substr") or ()), drops,
        tuple(wrapped.get("tower_prefixes") or ()), entry.get("class"), entry.get("backend", "vllm"),
        arch_table.table_version(),
    )
