"""Bytes by range from any pinned remote source.

The source protocol, the fetcher (window, order, resume), partial files on disk, the fault policy. Nothing here
names the Hub or a store.
"""
