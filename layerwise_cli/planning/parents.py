"""Map checkpoint tensors to the engine modules ("parent layers") that consume them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from layerwise_cli.planning.skip_rules import SkipRules, is_output_head, skip_rules_for

# Fusions vLLM applies in its dense decoder models (`packed_modules_mapping`).
_QKV_PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_DENSE_PACKED = {**_QKV_PACKED, "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

# Architectures whose mapping is known exactly: checkpoint module -> vLLM module,
# and whether experts are fused into one module per layer.
ARCHITECTURE_TABLE: dict[str, dict[str, object]] = {
    "Qwen3ForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": False},
    "Qwen2ForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": False},
    "LlamaForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": False},
    "MistralForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": False},
    "Qwen3MoeForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": True},
    "Qwen2MoeForCausalLM": {"packed": _DENSE_PACKED, "fused_experts": True},
    # Mixtral has no dense MLP: its experts' w1/w3 fuse inside the experts module.
    "MixtralForCausalLM": {"packed": _QKV_PACKED, "fused_experts": True},
}

_EXPERT_RE = re.compile(r"^(?P<head>.*\.experts)\.\d+\.")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class ParentLayer:
    """Where a tensor goes: the engine module name and its place in model order."""

    name: str
    # (section, decoder layer index): 0 embeddings, 1 decoder layers, 2 final
    # norm and other modules after the layers, 3 output head.
    order_key: tuple[int, int]


@dataclass(frozen=True)
class LayerMapping:
    """A rule set mapping checkpoint tensor names to parent layers.

    `kind` says where the rules came from: `table` (this project's table for a
    known architecture), `vllm` (read from the installed vLLM's model class) or
    `generic` (unknown architecture: grouped by the outermost layer index).
    """

    kind: str
    architecture: str | None
    packed: dict[str, str] = field(default_factory=dict)
    fused_experts: bool = True
    tie_word_embeddings: bool = False
    # vLLM's skip rules for the architecture (None: the package's rules, from the fields above).
    skips: SkipRules | None = None

    def __post_init__(self) -> None:
        if self.skips is None:
            object.__setattr__(self, "skips", skip_rules_for(self.architecture, None,
                                                             tied=self.tie_word_embeddings))

    def skip_reason(self, tensor_name: str) -> str | None:
        """Why vLLM's loader skips a checkpoint tensor on purpose (see `skip_rules`), or None if it loads it."""
        assert self.skips is not None
        return self.skips.reason(tensor_name)

    @property
    def description(self) -> str:
        arch = self.architecture or "unknown architecture"
        return {
            "table": f"{arch}: layerwise's architecture table",
            "vllm": f"{arch}: read from the installed vLLM's model class",
            "generic": f"{arch}: generic fallback, grouped by outermost layer index (fusions unknown)",
        }[self.kind]

    def parent_of(self, tensor_name: str) -> ParentLayer | None:
        """Return the parent layer of a checkpoint tensor, or None if vLLM skips it.

        Args:
            tensor_name: the name as stored in the checkpoint.

        Returns:
            The parent layer, or None for tensors vLLM's loader skips on
            purpose (`skip_reason`: rotary caches, a tied `lm_head`, MTP layers).
        """
        if self.skip_reason(tensor_name) is not None:
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
        if self.kind == "generic":
            # Fusions are unknown, and a fused module never spans two decoder
            # layers: a whole decoder layer is the one safe unit to complete.
            match = _LAYER_RE.search(module)
            if match:
                module = module[: match.end() - 1]
        return ParentLayer(module, _order_key(module))


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
        prefer: `auto` (table for known architectures, else vLLM's model class
            when vLLM is installed, else generic), `table`, `vllm` or `generic`.
        model_cls: vLLM's model class for the architecture (in a worker, the
            engine's own): its skip rules are read from it. None: read from the
            class only when the mapping itself comes from vLLM; else the
            package's skip rules.

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

    def skips(cls: type | None) -> SkipRules:
        return skip_rules_for(arch, config, model_cls=cls, tied=tied)

    if prefer in {"auto", "table"} and arch in ARCHITECTURE_TABLE:
        entry = ARCHITECTURE_TABLE[arch]
        return LayerMapping("table", arch, dict(entry["packed"]), bool(entry["fused_experts"]), tied,
                            skips(model_cls))
    if prefer in {"auto", "vllm"} and arch:
        from layerwise_cli.planning.vllm_mapping import fusions_from_vllm, model_class_if_installed

        found = fusions_from_vllm(arch, required=prefer == "vllm")
        if found is not None:
            packed, fused_experts = found
            return LayerMapping("vllm", arch, packed, fused_experts, tied,
                                skips(model_cls or model_class_if_installed(arch)))
    if prefer in {"table", "vllm"}:
        from layerwise_cli.errors import LayerwiseError

        if arch is None:
            raise LayerwiseError(f"--mapping {prefer} needs config.json's architectures; the checkpoint has none")
        raise LayerwiseError(f"architecture {arch!r} is not in layerwise's table (try --mapping auto)")
    return LayerMapping("generic", arch, {}, True, tied, skips(model_cls))
