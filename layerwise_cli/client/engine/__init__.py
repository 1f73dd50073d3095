"""The engine in this process.

Start it with layerwise's extension, fetch or prefetch its source, reload into it, answer from it.
"""
