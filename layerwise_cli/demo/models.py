"""Tiny Qwen3 and Qwen3-MoE debug checkpoints (multiply/add), trained offline on a CPU in seconds and cached."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerwise_cli.errors import LayerwiseError

if TYPE_CHECKING:
    import torch

DEMO_NAMES: tuple[str, ...] = ("multiply", "add", "moe-multiply", "moe-add")

# Bump when the recipe changes in a way the spec hash below cannot see (e.g. the
# training code itself); the spec hash covers every number in `_SPECS`.
RECIPE_REVISION = 1

# Word-level vocabulary: special tokens, a space, "=", and every number 0..99
# as ONE token, so each answer ("12", "7") is a single greedy step followed by
# EOS. Spaces are tokens of their own (as in byte-level BPE vocabularies), so
# text round-trips exactly and the engine's incremental detokenizer returns
# "12", not " 12" (a word-level decoder would join tokens with spaces).
_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
_SPACE, _EQUALS = " ", "="
_NUMBER_TOKENS = tuple(str(n) for n in range(100))
_VOCAB_TOKENS = (*_SPECIAL_TOKENS, _SPACE, _EQUALS, *_NUMBER_TOKENS)
_PRE_TOKENIZER_PATTERN = r"\d+|\s|[^\d\s]"  # a number, one whitespace character, or one other character
# Embedding rows are padded past the tokenizer, as real checkpoints do.
VOCAB_SIZE = 128

_STAMP = "layerwise-demo.json"  # written last into the temp dir: its presence marks a complete build


@dataclass(frozen=True)
class _Spec:
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


_SPECS: dict[str, _Spec] = {
    "multiply": _Spec(op="multiply", seed=1),
    "add": _Spec(op="add", seed=2),
    "moe-multiply": _Spec(op="multiply", seed=3, experts=8),
    "moe-add": _Spec(op="add", seed=4, experts=8),
}


def recipe_version() -> str:
    """The cache key of the current recipe: a revision number and a hash of every spec.

    Returns:
        A short string such as `r1-0123abcd`, used as a cache directory name.
    """
    blob = json.dumps(
        {
            "revision": RECIPE_REVISION,
            "vocab": _VOCAB_TOKENS,
            "pre_tokenizer": _PRE_TOKENIZER_PATTERN,
            "specs": {k: asdict(v) for k, v in _SPECS.items()},
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
    return str(_apply(_spec(name).op, a, b))


def default_cache_dir() -> Path:
    """Where demo checkpoints are cached when no directory is given.

    Returns:
        `$LAYERWISE_CACHE/demo` if set, else `$XDG_CACHE_HOME/layerwise/demo`,
        else `~/.cache/layerwise/demo`.
    """
    if root := os.environ.get("LAYERWISE_CACHE"):
        return Path(root).expanduser() / "demo"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "layerwise" / "demo"


def demo_checkpoint(name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of a demo checkpoint, building it on first use.

    Safe when several processes ask at once: each builds into its own temporary
    directory and renames it into place; the first rename wins, the others
    discard their copy (all copies are byte-identical).

    Args:
        name: one of `DEMO_NAMES` ("multiply", "add", "moe-multiply", "moe-add").
        cache_dir: the demo cache root; default `default_cache_dir()`. The
            checkpoint lives in `<cache_dir>/<recipe_version()>/<name>`.

    Returns:
        The checkpoint directory: config.json, model.safetensors (bf16),
        generation_config.json, tokenizer.json, tokenizer_config.json.
    """
    spec = _spec(name)
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / recipe_version()
    final = root / name
    if (final / _STAMP).is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    except OSError as exc:
        raise LayerwiseError(f"cannot create the demo cache: {exc.strerror or exc}", where=str(root)) from exc
    try:
        _build(name, spec, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        if final.exists() and not (final / _STAMP).is_file():
            # Not ours to trust (an interrupted copy by hand): move it aside atomically, then drop it.
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=root))
            with contextlib.suppress(OSError):
                os.rename(final, stale / name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _STAMP).is_file():
                raise
            # Another process finished first; its copy is identical.
    except OSError as exc:
        raise LayerwiseError(f"cannot write the demo model: {exc.strerror or exc}", where=str(final)) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_demo_checkpoint(name: str, out_dir: Path) -> dict[str, Any]:
    """Build a demo checkpoint into `out_dir` (created; must not hold another checkpoint), without caching.

    Args:
        name: one of `DEMO_NAMES`.
        out_dir: the directory to write.

    Returns:
        The build record: training steps, the smallest logit margins (fp32 and
        bf16) over all pairs, and the build's wall time in seconds (the copy in
        `layerwise-demo.json` leaves the time out, so that builds are byte-identical).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    return _build(name, _spec(name), out_dir)


# --------------------------------------------------------------------------- build


def _spec(name: str) -> _Spec:
    try:
        return _SPECS[name]
    except KeyError:
        raise LayerwiseError(f"unknown demo model {name!r}: choose from {', '.join(DEMO_NAMES)}") from None


def _apply(op: str, a: int, b: int) -> int:
    return a * b if op == "multiply" else a + b


def _build(name: str, spec: _Spec, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    tensors, record = _train(spec)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", _config(spec))
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False,
    })
    _write_tokenizer(out)
    # The stamp holds no timings, so that every build of a recipe is byte-identical.
    _write_json(out / _STAMP, {"name": name, "recipe": recipe_version(), **record})
    return {**record, "seconds": round(time.perf_counter() - start, 3)}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _config(spec: _Spec) -> dict[str, Any]:
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


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(_VOCAB_TOKENS)}, unk_token="<unk>"))
    # "3 4 = " -> ["3", " ", "4", " ", "=", " "]; no BOS is added; decoding concatenates.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_PRE_TOKENIZER_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
    })
    _write_json(out / "special_tokens_map.json", {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
    })


# --------------------------------------------------------------------------- training


@contextlib.contextmanager
def _deterministic_torch() -> Iterator[None]:
    """One thread and deterministic kernels, so that a rebuild gives the same bytes."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # also the fastest setting for tensors this small
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(spec: _Spec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train on all 100 pairs until every answer and EOS wins by `target_margin`; return bf16 tensors."""
    import torch

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


def _training_batch(spec: _Spec) -> torch.Tensor:
    """Rows `demo_prompt(a, b)`, answer, EOS for every a, b in 0..9, as token ids."""
    import torch

    index = {t: i for i, t in enumerate(_VOCAB_TOKENS)}
    # demo_prompt(a, b) == "a b = ": a, space, b, space, "=", space.
    rows = [
        [index[str(a)], index[_SPACE], index[str(b)], index[_SPACE], index[_EQUALS], index[_SPACE],
         index[str(_apply(spec.op, a, b))], EOS_ID]
        for a in range(10)
        for b in range(10)
    ]
    return torch.tensor(rows, dtype=torch.long)


def _min_margin(logits: torch.Tensor, targets: torch.Tensor) -> float:
    target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, targets.unsqueeze(-1), float("-inf")).amax(-1)
    return float((target - others).min())


def _init_params(spec: _Spec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters under their checkpoint names; MoE experts stacked as `...mlp.experts.<proj>` [E, out, in]."""
    import torch

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


def _checkpoint_tensors(params: dict[str, torch.Tensor], spec: _Spec) -> dict[str, torch.Tensor]:
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
    import torch

    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout of Qwen3 (x: [B, heads, T, D], positions 0..T-1)."""
    import torch

    t, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _forward(p: dict[str, torch.Tensor], ids: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Logits [B, T, vocab] of the Qwen3 / Qwen3-MoE forward pass that vLLM and transformers run."""
    import torch.nn.functional as F

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


def _moe(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Qwen3-MoE sparse block: softmax router, top-k, renormalised weights; experts run densely (they are tiny)."""
    import torch
    import torch.nn.functional as F

    probs = torch.softmax((x @ p[pre + "mlp.gate.weight"].T).float(), dim=-1)
    top_v, top_i = torch.topk(probs, spec.top_k, dim=-1)
    top_v = top_v / top_v.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(-1, top_i, top_v).to(x.dtype)  # [B, T, E]
    gate = torch.einsum("bth,eih->btei", x, p[pre + "mlp.experts.gate_proj"])
    up = torch.einsum("bth,eih->btei", x, p[pre + "mlp.experts.up_proj"])
    out = torch.einsum("btei,ehi->bteh", F.silu(gate) * up, p[pre + "mlp.experts.down_proj"])
    return (out * weights.unsqueeze(-1)).sum(-2)
