"""What vLLM's reload leaves undone or wrong, repaired: derived state, CPU kernels, put-back layers, AMX MLA, rope."""
