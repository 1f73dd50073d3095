"""The user's process: an engine in this process, running servers over HTTP, and `watch`.

Rooms, in import order (`scripts/check_imports.py`): `pinning` (a source's identity resolved once, for every room)
-> `delivery` (how its bytes arrive, decided once) -> `engine` (in process), `servers` (over HTTP) -> `watch`
(keeps either on the newest step).
"""
