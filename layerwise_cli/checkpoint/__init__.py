"""Safetensors checkpoints: read, pinned and fetched from wherever they live, without torch.

Rooms, in import order (`scripts/check_imports.py`): `format` (the bytes of a file) -> `fetch` (bytes by range from any
pinned source) -> `hub`, `store` (each remote source: its pin, headers and range source), `local_pin` (local files
pinned by their identities) -> `sources` (a SOURCE string
opened as a `Checkpoint`) -> `delta` (sparse delta steps) -> `steps` (a run's step folders) -> `shard_copy` (whole
shards fetched for a copy).
"""
