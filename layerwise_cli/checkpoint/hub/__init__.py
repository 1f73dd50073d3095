"""The Hugging Face Hub as a source.

A revision pinned to one commit, headers read by range, the Hub's range source and its cache.
"""
