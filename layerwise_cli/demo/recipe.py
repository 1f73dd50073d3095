"""The demo models' recipe: what they compute (multiply, add), their prompts and answers, vocabulary and config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from layerwise_cli.errors import LayerwiseError

DEMO_NAMES: tuple[str, ...] = ("multiply", "add", "moe-multiply", "moe-add")

# Bump when the recipe changes in a way the spec hash below cannot see (e.g. the
# training code itself); the spec hash covers every number in `SPECS`.
RECIPE_REVISION = 1

# Word-level vocabulary: special tokens, a space, "=", and every number 0..99
# as ONE token, so each answer ("12", "7") is a single greedy step followed by
# EOS. Spaces are tokens of their own (as in byte-level BPE vocabularies), so
# text round-trips exactly and the engine's incremental detokenizer returns
# "12", not " 12" (a word-level decoder would join tokens with spaces).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
SPACE, EQUALS = " ", "="
NUMBER_TOKENS = tuple(str(n) for n in range(100))
VOCAB_TOKENS = (*SPECIAL_TOKENS, SPACE, EQUALS, *NUMBER_TOKENS)
PRE_TOKENIZER_PATTERN = r"\d+|\s|[^\d\s]"  # a number, one whitespace character, or one other character
# Embedding rows are padded past the tokenizer, as real checkpoints do.
VOCAB_SIZE = 128


@dataclass(frozen=True)
class Spec:
    """Everything that determines a demo checkpoint's bytes."""

    op: str  # "multiply" or "add"
    seed: int
    experts: int = 0  # 0: dense Qwen3; >0: Qwen3-MoE
    top_k: int = 2
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64  # vLLM's CPU attention backend rejects 16; 64 works
    intermediate: int = 128
    moe_intermediate: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.1
    lr: float = 1e-2
    max_steps: int = 1500
    check_every: int = 25
    target_margin: float = 6.0  # stop once every target logit leads the runner-up by this much (fp32)
    min_bf16_margin: float = 2.0  # the build fails unless the bf16 model keeps this lead


SPECS: dict[str, Spec] = {
    "multiply": Spec(op="multiply", seed=1),
    "add": Spec(op="add", seed=2),
    "moe-multiply": Spec(op="multiply", seed=3, experts=8),
    "moe-add": Spec(op="add", seed=4, experts=8),
}


def recipe_version() -> str:
    """The cache key of the current recipe: a revision number and a hash of every spec.

    Returns:
        A short string such as `r1-0123abcd`, used as a cache directory name.
    """
    blob = json.dumps(
        {
            "revision": RECIPE_REVISION,
            "vocab": VOCAB_TOKENS,
            "pre_tokenizer": PRE_TOKENIZER_PATTERN,
            "specs": {k: asdict(v) for k, v in SPECS.items()},
        },
        sort_keys=True,
    )
    return f"r{RECIPE_REVISION}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def demo_prompt(a: int, b: int) -> str:
    """The prompt the demo models answer.

    Args:
        a: first operand, 0..9.
        b: second operand, 0..9.

    Returns:
        `f"{a} {b} = "`, e.g. `"3 4 = "`.
    """
    return f"{a} {b} = "


def expected_answer(name: str, a: int, b: int) -> str:
    """What a demo model's greedy completion of `demo_prompt(a, b)` is (before EOS).

    Args:
        name: one of `DEMO_NAMES`.
        a: first operand, 0..9.
        b: second operand, 0..9.

    Returns:
        The answer as text: `"12"` for multiply 3 4, `"7"` for add 3 4.
    """
    return str(apply(spec_for(name).op, a, b))


def spec_for(name: str) -> Spec:
    """The spec of demo model NAME, or a one-line error naming the choices."""
    try:
        return SPECS[name]
    except KeyError:
        raise LayerwiseError(f"unknown demo model {name!r}: choose from {', '.join(DEMO_NAMES)}") from None


def apply(op: str, a: int, b: int) -> int:
    """The answer a demo model of operation OP gives for A and B."""
    return a * b if op == "multiply" else a + b


def model_config(spec: Spec) -> dict[str, Any]:
    """A config.json shaped like Qwen3-0.6B's (and Qwen3-30B-A3B's for MoE)."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if spec.experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if spec.experts else "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 128,
        "max_window_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }
    if spec.experts:
        config.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": spec.moe_intermediate,
            "norm_topk_prob": True,
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.top_k,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    return config
