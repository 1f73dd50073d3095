"""What a worker keeps between reloads: per-layer records and state digests, the spot checks, the plan cache."""
