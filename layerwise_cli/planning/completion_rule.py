"""vLLM's completion rule: which parent layers its layerwise reload holds until the end of the stream."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from layerwise_cli.checkpoint.format.header import TensorEntry

# vLLM's layer buffer (`online_process_loader` in
# vllm/model_executor/model_loader/reload/layerwise.py) processes a module as
# soon as the elements its weight loaders copied reach the module's size
# (`load_numel >= load_numel_total`, sizes from `get_layer_size`, which
# honours a parameter's `weight_loader_numel`). A module whose parameters the
# checkpoint cannot fill never gets there: its tensors stay buffered until
# `finalize_layerwise_processing`, after the last tensor of the stream. Two
# cases arise from checkpoint headers alone:
#
# - Padded vocabularies. `VocabParallelEmbedding` and `ParallelLMHead` round
#   the vocabulary up to a multiple of 64 (`pad_vocab_size`,
#   `DEFAULT_VOCAB_PADDING_SIZE`), split the padded rows evenly over the
#   tensor-parallel ranks, and their loader copies only the checkpoint's rows
#   (the padding is zero-filled, not copied, and not declared as
#   `weight_loader_numel`). A rank whose slice reaches into the padding never
#   completes. With tensor parallelism that is the last rank(s) only.
# - Fused layers a checkpoint covers partly (`--allow-partial` without v_proj,
#   an expert missing from a fused experts module).
#
# Not modelled (no case on the architectures layerwise plans, or no CPU engine
# to measure them): attention modules (vLLM defers them to the end, but they
# load nothing from the checkpoints planned here unless it carries kv-cache
# scales), parameters a quantization method creates beyond the checkpoint.
# Online quantization methods (`uses_meta_device`: vLLM's FP8 and int8 MoE
# methods, layerwise's `layerwise_fp8`/`layerwise_int8`) create their scales
# only when processing, so their layers complete on the checkpoint's elements
# and buffer its (bf16) bytes: the rule holds unchanged
# (tests/test_online_quant_engine.py measures it).

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

# vLLM's `SKIP_LOAD_TENSORS` (reload/meta.py): tensors its reload never moves to the meta device nor wraps a
# loader of, so that its layer buffer neither holds them nor counts them towards a module's completion. A
# checkpoint tensor of that name (ERNIE-4.5-MoE's and DeepSeek-V3's `gate.e_score_correction_bias`) is written
# straight into the engine's tensor when the model's loader reaches it: buffered only while it is handed over.
DIRECT_LOAD_TENSORS = frozenset({
    "_expert_map",
    "expert_mask",
    "expert_global_to_physical",
    "expert_physical_to_global",
    "expert_local_to_global",
    "e_score_correction_bias",
})

_EXPERT_RE = re.compile(r"\.experts\.(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class HeldLayer:
    """A parent layer vLLM keeps buffered from its first tensor until the end of the stream."""

    name: str
    reason: str
    # Tensor-parallel ranks that hold it (all ranks unless the rule depends on the rank).
    ranks: tuple[int, ...]
    # `vocabulary` (padding: harmless), `uncounted` (a tensor of it is loaded outside vLLM's count: harmless) or
    # `partial` (a fused layer the checkpoint covers partly: vLLM fills the rest from fresh memory, uninitialized
    # before 0.34, zeros from 0.34).
    kind: str = "vocabulary"


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    """The vocabulary size vLLM allocates: `vocab` rounded up to a multiple of `padding`."""
    return -(-vocab // padding) * padding


def vocab_shard_rows(vocab: int, tensor_parallel_size: int, rank: int, padding: int = VOCAB_PADDING) -> tuple[int, int]:
    """Rows of a vocabulary tensor one rank loads, and the rows its slice of the engine's tensor has.

    Args:
        vocab: rows of the checkpoint's tensor (`config.json`'s `vocab_size`).
        tensor_parallel_size: ranks the padded vocabulary is split over.
        rank: this rank.
        padding: vLLM's padding multiple.

    Returns:
        (loaded rows, partition rows); the layer completes on this rank only
        when they are equal.
    """
    padded = padded_vocab(vocab, padding)
    per_rank = padded // tensor_parallel_size
    start = rank * per_rank
    return min(vocab, start + per_rank) - min(vocab, start), per_rank


def vocab_hold(name: str, vocab: int, tensor_parallel_size: int = 1) -> HeldLayer | None:
    """The hold of a vocabulary layer (`embed_tokens`, `lm_head`) with `vocab` rows, or None if it completes."""
    ranks = tuple(r for r in range(tensor_parallel_size)
                  if (rows := vocab_shard_rows(vocab, tensor_parallel_size, r))[0] < rows[1])
    if not ranks:
        return None
    reason = f"vocabulary padded {vocab} -> {padded_vocab(vocab)}"
    if tensor_parallel_size > 1:
        loaded = [vocab_shard_rows(vocab, tensor_parallel_size, r)[0] for r in ranks]
        per_rank = vocab_shard_rows(vocab, tensor_parallel_size, 0)[1]
        if len(ranks) == 1:
            reason += f"; rank {ranks[0]} of {tensor_parallel_size} fills {loaded[0]} of its {per_rank} rows"
        else:
            reason += (f"; ranks {', '.join(map(str, ranks))} of {tensor_parallel_size} fill "
                       f"{', '.join(map(str, loaded))} of their {per_rank} rows")
    return HeldLayer(name, reason, ranks)


def is_vocabulary_layer(order_key: tuple[int, int]) -> bool:
    """Embeddings and output heads: the sections of model order vLLM builds as vocabulary-parallel layers."""
    return order_key[0] in (0, 3)


def partial_fused_hold(name: str, tensor_names: Iterable[str], packed: Mapping[str, str],
                       config: Mapping | None, tensor_parallel_size: int = 1) -> HeldLayer | None:
    """The hold of a fused parent layer the checkpoint covers only partly, or None if it is covered.

    Args:
        name: the parent layer (`...qkv_proj`, `...mlp.experts`).
        tensor_names: the checkpoint's tensors of that layer.
        packed: the mapping's fusions (checkpoint module -> fused module).
        config: `config.json` (for the number of experts).
        tensor_parallel_size: ranks (the hold applies to all).
    """
    names = list(tensor_names)
    leaf = name.rsplit(".", 1)[-1]
    missing: list[str] = []
    if leaf == "experts":
        count = _expert_count(config)
        found: dict[int, set[str]] = {}
        for tensor in names:
            match = _EXPERT_RE.search(tensor)
            if match:
                found.setdefault(int(match.group("index")), set()).add(match.group("rest"))
        if count is None or not found:
            return None
        kinds = set().union(*found.values())
        absent = [e for e in range(count) if found.get(e, set()) != kinds]
        if absent:
            shown = ", ".join(map(str, absent[:4])) + (f" and {len(absent) - 4} more" if len(absent) > 4 else "")
            missing.append(f"expert{'s' if len(absent) > 1 else ''} {shown} of {count}")
    else:
        members = sorted(part for part, fused in packed.items() if fused == leaf)
        if not members:
            return None
        present: dict[str, set[str]] = {}
        for tensor in names:
            module, _, param = tensor.rpartition(".")
            present.setdefault(module.rsplit(".", 1)[-1], set()).add(param)
        if leaf in present:  # the checkpoint already stores the fused module
            return None
        params = set().union(*present.values()) if present else set()
        missing = [f"{member}.{param}" for member in members for param in sorted(params)
                   if param not in present.get(member, set())]
    if not missing:
        return None
    return HeldLayer(name, f"{', '.join(missing)} not in the checkpoint", tuple(range(tensor_parallel_size)),
                     "partial")


def held_layers(groups: Mapping[str, list[TensorEntry]], order_keys: Mapping[str, tuple[int, int]],
                packed: Mapping[str, str], config: Mapping | None, *, generic: bool,
                tensor_parallel_size: int = 1, uncounted: Mapping[str, str] | None = None,
                vocabulary_layers: Collection[str] | None = None) -> dict[str, HeldLayer]:
    """Every parent layer vLLM will hold to the end of the stream, with the reason.

    Args:
        groups: parent layer -> its checkpoint tensors.
        order_keys: parent layer -> its place in model order.
        packed: the mapping's fusions.
        config: `config.json`, or None.
        generic: the mapping is the generic fallback (fusions unknown: only
            the vocabulary rule applies).
        tensor_parallel_size: the engine's tensor-parallel ranks.
        uncounted: parent layer -> why vLLM's count of it never completes (a tensor its model loads outside
            the count, which the count still expects: the Transformers backend's `lm_head.bias`).
        vocabulary_layers: the parent layers the engine built vocabulary-parallel; None: every embedding and
            output head with a matrix.

    Returns:
        Parent layer -> its hold, in the order of `groups`.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, not {tensor_parallel_size}")
    held: dict[str, HeldLayer] = {}
    for name, entries in groups.items():
        hold = None
        rows = {entry.shape[0] for entry in entries if entry.shape}
        matrix = any(len(entry.shape) == 2 for entry in entries)  # not a norm that sorts with the embeddings
        vocabulary = vocabulary_layers is None or name in vocabulary_layers
        if is_vocabulary_layer(order_keys[name]) and vocabulary and matrix and len(rows) == 1:
            # vLLM sizes the layer from config.json's vocab_size and asserts the
            # checkpoint's rows equal it, so the rows are the vocabulary.
            hold = vocab_hold(name, rows.pop(), tensor_parallel_size)
        elif not generic:
            hold = partial_fused_hold(name, [e.name for e in entries], packed, config, tensor_parallel_size)
        if name in (uncounted or {}) and (hold is None or hold.kind == "vocabulary"):
            # On every rank, whatever share of a padded vocabulary the rank holds.
            reason = (uncounted or {})[name] + (f"; {hold.reason}" if hold is not None else "")
            hold = HeldLayer(name, reason, tuple(range(tensor_parallel_size)), "uncounted")
        if hold is not None:
            held[name] = hold
    return held


def _expert_count(config: Mapping | None) -> int | None:
    if not isinstance(config, Mapping):
        return None
    for section in (config, config.get("text_config")):
        if isinstance(section, Mapping):
            for key in _EXPERT_COUNT_KEYS:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None
