"""Showing what the engine holds: --verify, fingerprints, checksums, and consensus across ranks."""
