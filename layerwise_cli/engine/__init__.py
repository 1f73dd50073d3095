"""Engine side: what runs inside vLLM workers, and how the tool drives an engine."""
