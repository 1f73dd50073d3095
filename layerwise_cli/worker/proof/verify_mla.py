"""`--verify` for what MLA attention derives from `kv_b_proj`: `W_UV` and `W_UK_T`, recomputed from SOURCE.

vLLM's `MLAAttention.process_weights_after_loading` splits `kv_b_proj`'s
weight (dequantized) with `split_kv_b_proj` into `W_UK [L, N, P]` and
`W_UV [L, N, V]`, and keeps `W_UV` as `(N, L, V)` and `W_UK_T` as `(N, P, L)`
(`replace_parameter(..., prefer_copy=True)`). With an unquantized `kv_b_proj`
of the engine's dtype both are views of its weight; with a quantized one, or
another dtype, they are copies. Either way they are recomputed here the way
vLLM computes them, from `kv_b_proj` as SOURCE loads it (the private copy
`--verify` loaded and processed for that layer), and compared with the
engine's, bit for bit. On vLLM's AMX CPU backend, which derives no `W_UV`/`W_UK_T`
but packs its own (`_w_uk_packed`, `_w_uv_packed`, on the attention's impl) and
empties `kv_b_proj.weight`, those are recomputed by running the backend's own
packing on a copy of its impl holding SOURCE's `kv_b_proj`. ROCm aiter's
quantized `W_K`/`W_V` and the decode-context-parallel copy (`W_UK_T_dcp_qrep`)
are not recomputed: such a module is reported `skipped`, which fails `--verify`.
"""

from __future__ import annotations

import copy

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.errors import describe_exception
from layerwise_cli.worker.proof.checksums import tensor_sha256

DERIVED = ("W_UV", "W_UK_T")
# What vLLM's AMX MLA backend (x86 CPUs with AMX) packs from kv_b_proj instead, on the attention's impl.
AMX_DERIVED = ("_w_uk_packed", "_w_uv_packed")


def mla_modules(model: torch.nn.Module, parents: set[str]) -> dict[str, str]:
    """MLA attention module name -> the name of its `kv_b_proj`, for each whose `kv_b_proj` is one of PARENTS."""
    mla_class = vllm_compat.mla_attention_class()
    names = {id(module): name for name, module in model.named_modules()}
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, mla_class):
            kv_b_proj = names.get(id(getattr(module, "kv_b_proj", None)))
            if kv_b_proj in parents:
                found[name] = kv_b_proj
    return found


def expected_mla_tensors(module, kv_b_proj) -> dict[str, torch.Tensor]:
    """`W_UV` and `W_UK_T` as vLLM derives them for MODULE from KV_B_PROJ (a loaded and processed copy)."""
    dtype = module.W_UV.dtype
    w_uk, w_uv = vllm_compat.split_kv_b_proj()(kv_b_proj, dtype, module.kv_lora_rank, module.num_heads,
                                               module.qk_nope_head_dim, module.v_head_dim)
    return {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}


def expected_amx_packed(module, kv_b_proj) -> dict[str, torch.Tensor]:
    """What vLLM's AMX MLA backend packs for MODULE from KV_B_PROJ: its own packing, run on a copy of its impl."""
    impl = copy.copy(module.impl)
    impl.kv_b_proj = kv_b_proj
    impl.process_weights_after_loading(kv_b_proj.weight.dtype)
    return {key: getattr(impl, key) for key in AMX_DERIVED}


def unrecomputed_layout(module) -> str | None:
    """Why MODULE's derived tensors are laid out in a way this check does not rebuild (None: it rebuilds them)."""
    if getattr(module, "is_amx_bmm_enabled", False):
        missing = [key for key in AMX_DERIVED if not isinstance(getattr(module.impl, key, None), torch.Tensor)]
        return f"vLLM's AMX MLA backend holds no {', '.join(missing)}" if missing else None
    if hasattr(module, "W_K"):
        return "vLLM's aiter MLA path quantizes kv_b_proj into W_K and W_V"
    if getattr(module, "W_UK_T_dcp_qrep", None) is not None:
        return "W_UK_T_dcp_qrep is gathered across decode-context-parallel ranks"
    if any(getattr(module, key, None) is None for key in DERIVED):
        return "it holds no W_UV/W_UK_T"
    return None


def verify_mla(model: torch.nn.Module, mla: dict[str, str], loaded: dict) -> list[dict]:
    """One `--verify` entry per MLA module of MLA: its W_UV and W_UK_T recomputed from SOURCE's kv_b_proj.

    Args:
        model: the engine's model.
        mla: `mla_modules(model, parents)`.
        loaded: parent name -> the private copy `--verify` loaded from SOURCE and processed.
    """
    entries = []
    for name, origin in mla.items():
        module = model.get_submodule(name)
        how = ("the AMX backend's packed W_UK and W_UV recomputed with its own packing"
               if getattr(module, "is_amx_bmm_enabled", False) else "W_UV and W_UK_T recomputed")
        entry = {"name": name, "status": "match", "compared": [], "derived_from": origin,
                 "detail": f"{how} from {origin} as SOURCE loads it"}
        copy = loaded.get(origin)
        why = unrecomputed_layout(module)
        if why is not None:
            entry.update(status="skipped", detail=f"derived from {origin}, not recomputed: {why}")
        elif copy is None:
            entry.update(status="skipped", detail=f"derived from {origin}, which was not checked")
        else:
            try:
                amx = getattr(module, "is_amx_bmm_enabled", False)
                holder = module.impl if amx else module
                with torch.no_grad():
                    expected = expected_amx_packed(module, copy) if amx else expected_mla_tensors(module, copy)
                    differing = [key for key, value in expected.items()
                                 if tuple(value.shape) != tuple(getattr(holder, key).shape)
                                 or tensor_sha256(value) != tensor_sha256(getattr(holder, key))]
            except Exception as exc:  # noqa: BLE001 - reported as not checkable, with why
                entry.update(status="error", detail=f"derived from {origin}; could not be recomputed from SOURCE: "
                             f"{describe_exception(exc)}")
                entries.append(entry)
                continue
            entry["compared"] = list(expected)
            if differing:
                entry.update(status="mismatch", detail=f"derived from {origin} and differs from what vLLM derives "
                             f"from SOURCE's {origin}: {', '.join(differing)}")
        entries.append(entry)
    return entries
