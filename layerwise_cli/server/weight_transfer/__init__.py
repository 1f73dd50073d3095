"""The `layerwise` backend of vLLM's weight-transfer API, inference side (`--weight-transfer-config`).

`--weight-transfer-config '{"backend": "layerwise"}'` on `layerwise serve` or `vllm serve` selects it.

Two processes, one module each:

- `engine.py` runs in every vLLM worker: the `WeightTransferEngine` vLLM builds for the backend. Its
  `update_weights` reloads the `update_info`'s source with layerwise's reload (layer order, skipping, delta patch,
  completion check, rollback) and keeps the per-layer report.
- `routes.py` runs in the API server: around vLLM's own routes, the pause lease from `/start_weight_update` to
  `/finish_weight_update`, failures answered as one line, and `GET /layerwise/update_report`.

`server/plugin.py` registers the backend (and `routes.py`) in every vLLM process where layerwise is installed.
The trainer side is `writer/trainer_engine.py`; what crosses between them is `worker/rpc.py`'s `TransferUpdate`.
"""
