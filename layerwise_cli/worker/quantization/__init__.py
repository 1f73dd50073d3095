"""layerwise's online quantization methods for any CPU (`layerwise_fp8`, `layerwise_int8`), registered with vLLM."""
