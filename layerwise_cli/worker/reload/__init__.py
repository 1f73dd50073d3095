"""One reload inside a worker, start to end: pre-flight, skip plan, the stream into vLLM, probe, rollback."""
