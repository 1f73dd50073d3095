"""Agreement among the workers of one engine: each step that changes weights runs on every rank or on none.

With pipeline parallelism the ranks check different tensors (their own
stage's), so one rank can refuse a source another accepts; with several
nodes, one node may not see the path at all. Before any rank touches its
weights, and again after the stream, the ranks of the engine vote over
vLLM's tensor- and pipeline-parallel CPU groups (gloo): a single "no" stops
them all, and ranks that did load roll back with the one that failed.
"""

from __future__ import annotations

from layerwise_cli import vllm_compat
from layerwise_cli.errors import LayerwiseError


class PeerFailed(LayerwiseError):
    """Another rank of this engine failed; this rank followed it (its own error is the other rank's)."""


def all_ranks_agree(ok: bool) -> bool:
    """True when every rank of this engine voted `ok`; every rank of the engine must call it the same times.

    A max-reduction of "failed" over the tensor-parallel group and then over
    the pipeline-parallel group reaches every rank of the tp x pp grid.
    Outside a vLLM worker, or with one rank, it returns `ok`.
    """
    try:
        import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched
        import torch.distributed as dist  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

        ps = vllm_compat.parallel_state()
    except Exception:  # noqa: BLE001 - no vLLM: a single process
        return ok
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32)
    for getter in (ps.get_tp_group, ps.get_pp_group):
        try:
            group = getter()
        except Exception:  # noqa: BLE001 - group not initialised: nobody else to ask
            continue
        if group.world_size > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(failed.item()) == 0
