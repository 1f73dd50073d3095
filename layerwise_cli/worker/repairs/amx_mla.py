"""Give vLLM's AMX MLA backend back the `kv_b_proj` weight it empties, so that a layerwise reload can load it.

What vLLM (0.32.0 to 0.34) does: on an x86 CPU with AMX tiles, MLA attention
(DeepSeek V2/V3 shapes) runs on `AMXMLAImpl`, whose
`process_weights_after_loading` packs its own `W_UK`/`W_UV` from
`kv_b_proj.weight` (`_w_uk_packed`, `_w_uv_packed`); then
`MLAAttention.process_weights_after_loading` replaces `kv_b_proj.weight` with
an empty `Parameter` ("release the now-unused raw weight"). vLLM's layerwise
reload keeps that empty tensor as `kv_b_proj`'s kernel tensor, loads the new
weight into a fresh tensor of the recorded shape, and copies it back into the
empty one: `_copy_and_restore_kernel_tensors` fails (512 columns into 0) and
the reload with it. vLLM's own `reload_weights` fails the same way.

The repair: before vLLM's reload, each emptied `kv_b_proj.weight` is replaced
by a tensor of the shape, dtype and device vLLM recorded for it (its
`restore_metadata`), so the reload has somewhere to copy the new weight; the
attention layer, which vLLM processes at the end of every reload, then packs
`W_UK`/`W_UV` from it and empties it again, as after a fresh load. The engine
ends as a fresh engine on the same weights does (`tests/test_mla_engine.py`).

What the new tensor holds until the reload loads it is undefined, so these
`kv_b_proj` layers must be loaded by every reload: never skipped as unchanged
(`must_hand_over`), never left out of a partial checkpoint
(`missing_message`). On other platforms nothing is done. Not a repair of what
vLLM leaves stale but what lets its reload run at all, so
`LAYERWISE_NO_REPAIRS` leaves it on.
"""

from __future__ import annotations

import torch

from layerwise_cli import vllm_compat


def amx_kv_b_proj(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`kv_b_proj` module name -> module, for each MLA attention on vLLM's AMX backend."""
    names = {id(module): name for name, module in model.named_modules()}
    found: dict[str, torch.nn.Module] = {}
    for module in model.modules():
        kv_b_proj = getattr(module, "kv_b_proj", None)
        if getattr(module, "is_amx_bmm_enabled", False) and id(kv_b_proj) in names:
            found[names[id(kv_b_proj)]] = kv_b_proj
    return found


def must_hand_over(model: torch.nn.Module) -> set[str]:
    """The layers every reload must load: those `kv_b_proj`s.

    All of them, emptied or not: one a reload gave back a tensor to and that vLLM then did not process
    (it refused the reload before loading) holds undefined values until a reload loads it.
    """
    return set(amx_kv_b_proj(model))


def missing_message(model: torch.nn.Module, covered: set[str]) -> str | None:
    """Why a checkpoint that does not cover every emptied `kv_b_proj` (COVERED: the parents it has) is refused."""
    missing = sorted(must_hand_over(model) - covered)
    if not missing:
        return None
    shown = ", ".join(missing[:2]) + (f" and {len(missing) - 2} more" if len(missing) > 2 else "")
    return (f"the checkpoint has no tensor for {shown}: vLLM's AMX MLA backend (this CPU) keeps no copy of "
            "kv_b_proj.weight after loading, so every reload must carry it")


def give_back_weights(model: torch.nn.Module) -> list[str]:
    """Before vLLM's reload: a tensor of the recorded shape for each emptied `kv_b_proj.weight`; their names."""
    infos = vllm_compat.layerwise_info()
    given = []
    for name, module in amx_kv_b_proj(model).items():
        if not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.numel():
            continue  # not emptied
        info = infos.get(module)
        recorded = info.restore_metadata[0].get("weight") if info is not None and info.restore_metadata else None
        if recorded is None:
            continue  # vLLM recorded nothing to restore: its reload does not touch this layer either
        # Only storage: the reload takes the loaders and dims from vLLM's record, not from this tensor.
        device = info.restore_device if info.restore_device is not None else module.weight.device
        module.weight = torch.nn.Parameter(torch.empty(recorded.shape, dtype=recorded.dtype, device=device),
                                           requires_grad=False)
        given.append(name)
    return given
