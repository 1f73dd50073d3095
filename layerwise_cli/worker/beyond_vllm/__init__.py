"""What layerwise does beyond vLLM's reload: derived state, CPU repairs, rerun hooks, online quantization."""
