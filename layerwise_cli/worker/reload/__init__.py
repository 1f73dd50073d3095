"""One reload inside a worker, start to end: pre-flight, unchanged layers, the stream into vLLM, probe, rollback."""
