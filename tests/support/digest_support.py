"""Header digests computed apart from the package (xxhash on the bytes safetensors reads), and one made wrong."""

from __future__ import annotations

from pathlib import Path

import xxhash
from safetensors import safe_open

from layerwise_cli.checkpoint.format.digests import header_digests, tensor_prefix
from layerwise_cli.checkpoint.format.header import read_shard_header

_SAFETENSORS_DTYPES = {"torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float16": "F16"}


def independent_digests(folder: Path) -> dict[str, str]:
    """Every tensor's digest from the bytes the safetensors library reads, hashed here with xxhash directly."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(name).contiguous()
                raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
                dtype = _SAFETENSORS_DTYPES[str(tensor.dtype)]
                out[name] = xxhash.xxh3_128(tensor_prefix(dtype, tensor.shape) + raw).hexdigest()
    return out


def corrupt_header_digest(path: Path, tensor: str) -> str:
    """Change one hex digit of TENSOR's digest in the header, in place (same length: offsets unchanged)."""
    header, _ = read_shard_header(path)
    digest = header_digests(header)[tensor]
    wrong = ("0" if digest[0] != "0" else "1") + digest[1:]
    raw = path.read_bytes()
    head = raw[: header.data_start]
    assert head.count(digest.encode()) == 1
    path.write_bytes(head.replace(digest.encode(), wrong.encode()) + raw[header.data_start:])
    return wrong
