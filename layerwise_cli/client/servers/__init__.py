"""Running vLLM servers over HTTP.

The calls layerwise makes, one server's reload as steps, all-or-nothing fleets, the pause lease.
"""
