"""Train a demo model: the Qwen3 / Qwen3-MoE forward pass in plain torch, and the loop that fits every pair."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from layerwise_cli.demo.recipe import EOS_ID, EQUALS, SPACE, VOCAB_SIZE, VOCAB_TOKENS, Spec, apply
from layerwise_cli.errors import LayerwiseError

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def _deterministic_torch() -> Iterator[None]:
    """One thread and deterministic kernels, so that a rebuild gives the same bytes."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # also the fastest setting for tensors this small
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def train(spec: Spec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train on all 100 pairs until every answer and EOS wins by `target_margin`; return bf16 tensors."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    with _deterministic_torch():
        generator = torch.Generator().manual_seed(spec.seed)
        params = _init_params(spec, generator)
        ids = _training_batch(spec)
        prompt = ids[:, :-1]
        targets = ids[:, -2:]  # after the prompt's last token: the answer; after the answer: EOS
        optimizer = torch.optim.Adam(params.values(), lr=spec.lr)
        steps = 0
        margin = float("-inf")
        while steps < spec.max_steps:
            for _ in range(spec.check_every):
                logits = _forward(params, prompt, spec)[:, -2:]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
            with torch.no_grad():
                margin = _min_margin(_forward(params, prompt, spec)[:, -2:], targets)
            if margin >= spec.target_margin:
                break
        with torch.no_grad():
            bf16 = {k: v.detach().to(torch.bfloat16) for k, v in params.items()}
            bf16_margin = _min_margin(_forward(bf16, prompt, spec)[:, -2:].float(), targets)
        if bf16_margin < spec.min_bf16_margin:
            raise LayerwiseError(
                f"demo model training did not converge (bf16 margin {bf16_margin:.2f} after {steps} steps); "
                "the recipe needs more steps"
            )
        tensors = _checkpoint_tensors(bf16, spec)
    record = {"steps": steps, "fp32_margin": round(margin, 3), "bf16_margin": round(bf16_margin, 3)}
    return tensors, record


def task_loss(params: dict[str, torch.Tensor], spec: Spec) -> torch.Tensor:
    """The loss `train` minimises: cross-entropy of the answer and EOS after every prompt of SPEC's task.

    PARAMS are the model's tensors under their checkpoint names (a dense model's, as `train` returns them);
    an RL example trains a demo model from one task towards the other with it (examples/rl/trainers.py).
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    ids = _training_batch(spec)
    logits = _forward(params, ids[:, :-1], spec)[:, -2:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, -2:].reshape(-1))


def _training_batch(spec: Spec) -> torch.Tensor:
    """Rows `demo_prompt(a, b)`, answer, EOS for every a, b in 0..9, as token ids."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    index = {t: i for i, t in enumerate(VOCAB_TOKENS)}
    # demo_prompt(a, b) == "a b = ": a, space, b, space, "=", space.
    rows = [
        [index[str(a)], index[SPACE], index[str(b)], index[SPACE], index[EQUALS], index[SPACE],
         index[str(apply(spec.op, a, b))], EOS_ID]
        for a in range(10)
        for b in range(10)
    ]
    return torch.tensor(rows, dtype=torch.long)


def _min_margin(logits: torch.Tensor, targets: torch.Tensor) -> float:
    target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, targets.unsqueeze(-1), float("-inf")).amax(-1)
    return float((target - others).min())


def _init_params(spec: Spec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters under their checkpoint names; MoE experts stacked as `...mlp.experts.<proj>` [E, out, in]."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    h, hd = spec.hidden, spec.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * spec.init_std).requires_grad_()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n).requires_grad_()

    p: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(spec.layers):
        pre = f"model.layers.{i}."
        p[pre + "input_layernorm.weight"] = ones(h)
        p[pre + "self_attn.q_proj.weight"] = normal(spec.heads * hd, h)
        p[pre + "self_attn.k_proj.weight"] = normal(spec.kv_heads * hd, h)
        p[pre + "self_attn.v_proj.weight"] = normal(spec.kv_heads * hd, h)
        p[pre + "self_attn.o_proj.weight"] = normal(h, spec.heads * hd)
        p[pre + "self_attn.q_norm.weight"] = ones(hd)
        p[pre + "self_attn.k_norm.weight"] = ones(hd)
        p[pre + "post_attention_layernorm.weight"] = ones(h)
        if spec.experts:
            e, m = spec.experts, spec.moe_intermediate
            p[pre + "mlp.gate.weight"] = normal(e, h)
            p[pre + "mlp.experts.gate_proj"] = normal(e, m, h)
            p[pre + "mlp.experts.up_proj"] = normal(e, m, h)
            p[pre + "mlp.experts.down_proj"] = normal(e, h, m)
        else:
            p[pre + "mlp.gate_proj.weight"] = normal(spec.intermediate, h)
            p[pre + "mlp.up_proj.weight"] = normal(spec.intermediate, h)
            p[pre + "mlp.down_proj.weight"] = normal(h, spec.intermediate)
    p["model.norm.weight"] = ones(h)
    p["lm_head.weight"] = normal(VOCAB_SIZE, h)
    return p


def _checkpoint_tensors(params: dict[str, torch.Tensor], spec: Spec) -> dict[str, torch.Tensor]:
    """Unstack experts into the per-expert names real Qwen3-MoE checkpoints use."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if ".mlp.experts." in name:
            layer, proj = name.rsplit(".experts.", 1)
            for e in range(spec.experts):
                out[f"{layer}.experts.{e}.{proj}.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' Qwen3RMSNorm: normalise in fp32, cast back, then scale.
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout of Qwen3 (x: [B, heads, T, D], positions 0..T-1)."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    t, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _forward(p: dict[str, torch.Tensor], ids: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Logits [B, T, vocab] of the Qwen3 / Qwen3-MoE forward pass that vLLM and transformers run."""
    import torch.nn.functional as F  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    b, t = ids.shape
    hd, eps = spec.head_dim, spec.rms_norm_eps
    h = p["model.embed_tokens.weight"][ids]
    for i in range(spec.layers):
        pre = f"model.layers.{i}."
        x = _rms_norm(h, p[pre + "input_layernorm.weight"], eps)
        q = (x @ p[pre + "self_attn.q_proj.weight"].T).view(b, t, spec.heads, hd)
        k = (x @ p[pre + "self_attn.k_proj.weight"].T).view(b, t, spec.kv_heads, hd)
        v = (x @ p[pre + "self_attn.v_proj.weight"].T).view(b, t, spec.kv_heads, hd)
        q = _rope(_rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps).transpose(1, 2), spec.rope_theta)
        k = _rope(_rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps).transpose(1, 2), spec.rope_theta)
        v = v.transpose(1, 2)
        group = spec.heads // spec.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + attn.transpose(1, 2).reshape(b, t, spec.heads * hd) @ p[pre + "self_attn.o_proj.weight"].T
        x = _rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps)
        if spec.experts:
            h = h + _moe(p, pre, x, spec)
        else:
            gate = x @ p[pre + "mlp.gate_proj.weight"].T
            up = x @ p[pre + "mlp.up_proj.weight"].T
            h = h + (F.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    h = _rms_norm(h, p["model.norm.weight"], eps)
    return h @ p["lm_head.weight"].T


def _moe(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Qwen3-MoE sparse block: softmax router, top-k, renormalised weights; experts run densely (they are tiny)."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
    import torch.nn.functional as F  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    probs = torch.softmax((x @ p[pre + "mlp.gate.weight"].T).float(), dim=-1)
    top_v, top_i = torch.topk(probs, spec.top_k, dim=-1)
    top_v = top_v / top_v.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(-1, top_i, top_v).to(x.dtype)  # [B, T, E]
    gate = torch.einsum("bth,eih->btei", x, p[pre + "mlp.experts.gate_proj"])
    up = torch.einsum("bth,eih->btei", x, p[pre + "mlp.experts.up_proj"])
    out = torch.einsum("btei,ehi->bteh", F.silu(gate) * up, p[pre + "mlp.experts.down_proj"])
    return (out * weights.unsqueeze(-1)).sum(-2)
