"""Runs inside vLLM's worker processes: the extension vLLM mixes into each worker, and the rooms it calls.

Rooms, in import order (a room imports only itself and the rooms before it;
`scripts/check_imports.py` enforces it): `rpc` (the call surface the client
shares), `stream`, `state`, `repairs`, `quantization`, `proof`, `reload`,
`extension`.
"""
