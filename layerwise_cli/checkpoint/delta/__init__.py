"""Sparse delta steps.

The file format, reading and checking a delta, encoding one, and a delta opened as the full step it rebuilds
(chains).
"""
