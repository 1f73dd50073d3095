"""The safetensors format as layerwise reads and writes it.

Headers, shard layout, digests, spot samples, finite checks, chunked reads. Nothing here knows where a file came
from.
"""
