"""What a delta patch writes into one engine tensor: each link's new values at their positions, oldest link first.

A v1 link carries its new values (positions and values, or the whole
tensor); a v2 link carries differences, added to the engine's bits as
integers (`checkpoint.delta.v2`), so its new values exist only once added.
Where the NaN/Inf check is on, the values the chain leaves at every position
a v2 link wrote are checked once, after the tensor's last link: a link whose
NaN a later link of the chain rewrites is no value of the step being loaded
(an RL step written against a refused NaN step), but a NaN that no later link
rewrites is refused. v1 links' values were checked before the engine was
touched (`preflight`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from layerwise_cli.checkpoint.delta.format import VALUES_SUFFIX, WHOLE, WHOLE_SUFFIX, Delta
from layerwise_cli.checkpoint.delta.v2 import SPARSE
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES
from layerwise_cli.errors import LayerwiseError

# The integer type a patch writes elements of each size as (bit for bit, whatever the dtype).
AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def decode_chunks(name: str, dtype: str, links: tuple[Delta, ...]) -> dict[tuple[str, int], list]:
    """Every v2 chunk of tensor NAME (of safetensors DTYPE) that LINKS patch, decoded.

    Returns:
        (NAME, link index) -> [(positions, differences)] as host torch tensors (positions int64; differences in
        `AS_INTEGERS`' type of the element's size).

    Raises:
        LayerwiseError: a chunk is corrupt (`Delta.changes`).
    """
    out = {}
    size = DTYPE_SIZES[dtype]
    signed = np.uint8 if size == 1 else np.dtype(f"i{size}")
    for index, link in enumerate(links):
        patch = link.patches.get(name)
        if patch is None or patch.kind != SPARSE:
            continue
        out[(name, index)] = [(torch.from_numpy(positions), torch.from_numpy(diffs.view(signed)))
                              for _, positions, diffs in link.changes(name)]
    return out


def write_links(name: str, region: torch.Tensor, links: tuple[Delta, ...], decoded: Mapping[tuple[str, int], list],
                *, check_finite: bool) -> int:
    """Write every link's new values of tensor NAME into REGION (its place in the engine), in place.

    Args:
        name: the checkpoint tensor's name.
        region: the engine's elements that hold it.
        links: the links the layer takes, oldest first.
        decoded: its v2 chunks (`decode_chunks`).
        check_finite: refuse a NaN or Inf the chain leaves where a v2 link wrote.

    Returns:
        the delta's bytes read (positions and values).

    Raises:
        LayerwiseError: a value the chain leaves at a position a v2 link wrote is NaN or Inf (`check_finite`);
            the reload then fails, and is rolled back.
    """
    as_integers = region.view(AS_INTEGERS[region.element_size()])
    read, added, last = 0, [], None
    for index, link in enumerate(links):
        patch = link.patches.get(name)
        if patch is None:
            continue
        read += link.patch_nbytes(name)
        if patch.kind == WHOLE:
            as_integers.copy_(_on(region.device, link.raw(name + WHOLE_SUFFIX), as_integers.dtype))
            added = []  # every value is the whole tensor's now, checked before the engine was touched
        elif patch.kind == SPARSE:
            for positions, diffs in decoded[(name, index)]:
                at = positions.to(region.device)
                # One kernel, in place (measured: faster than a gather, an add and a scatter); integer sums wrap.
                as_integers.index_add_(0, at, diffs.to(region.device))
                added.append(at)
            last = link
        else:
            positions = _read_only(link.positions(name))
            values = _on(region.device, link.raw(name + VALUES_SUFFIX), as_integers.dtype)
            as_integers.index_put_((positions.to(region.device),), values)
    if check_finite and added and region.dtype.is_floating_point:
        _refuse_nonfinite(name, region, as_integers, added, last)
    return read


def _refuse_nonfinite(name: str, region: torch.Tensor, as_integers: torch.Tensor, added: list[torch.Tensor],
                      link: Delta) -> None:
    """Raise when a value at ADDED's positions (those v2 links wrote) is NaN or Inf, naming the last such LINK."""
    for at in added:
        values = as_integers.index_select(0, at).view(region.dtype)  # measured: 1.7 x faster than [at]
        if not torch.isfinite(values if values.element_size() > 1 else values.float()).all():
            raise LayerwiseError(f"tensor {name}: the delta's new values hold NaN or Inf; refusing to load it "
                                 "(--allow-nonfinite loads it anyway)", where=str(link.path))


def _on(device: torch.device, raw, dtype: torch.dtype) -> torch.Tensor:
    """RAW (a numpy uint8 view of the delta's file) as elements of DTYPE on DEVICE."""
    tensor = _read_only(raw).view(dtype)
    return tensor if device.type == "cpu" else tensor.to(device)


def _read_only(array) -> torch.Tensor:
    """ARRAY (a view of the delta file's read-only mapping) as a tensor, without a copy.

    torch warns that it cannot mark a tensor read-only; these tensors are only ever read (the index and the
    source of a copy), so the warning is silenced here, and only here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)
