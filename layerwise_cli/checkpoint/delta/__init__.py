"""Sparse delta steps.

The file format, reading and checking a delta, encoding one, a delta opened as the full step it rebuilds
(chains), and its tensors rebuilt from the chain's full step and proved (`rebuild`).
"""
