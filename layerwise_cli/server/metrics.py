"""layerwise's own metrics on the server's `/metrics` (vLLM's Prometheus endpoint), next to vLLM's.

Recorded in the API server process from what passes through layerwise's
endpoints: each reload's answers (`/layerwise/engines_rpc` with
`layerwise_reload`), how long each reload held the engine cores, each
verification, each pause under a lease, and the
weight version set with a reload. They go to the registry vLLM's `/metrics`
serves (`prometheus_client`'s default one; vLLM's multiprocess registry reads
them too when `PROMETHEUS_MULTIPROC_DIR` is set). A version set through
vLLM's own `/update_weight_version` is not seen here.

| metric | kind | what |
| --- | --- | --- |
| `layerwise_reloads_total{result}` | counter | by result: `ok`, `refused`, `rolled_back`, `failed` |
| `layerwise_reload_seconds` | histogram | a reload's wall time inside the server |
| `layerwise_engine_stall_seconds` | histogram | a reload's time in the engine core: no step runs meanwhile |
| `layerwise_pause_seconds` | histogram | a pause under a lease, from the pause to its end |
| `layerwise_pause_drain_seconds` | histogram | its first part: in-flight requests finishing (`wait`) |
| `layerwise_pause_leases_expired_total` | counter | leases that ended because their client stopped renewing |
| `layerwise_read_bytes_total` | counter | checkpoint bytes read by the workers (summed over workers) |
| `layerwise_skipped_layers_total` | counter | layers left as they were, unchanged (summed over workers) |
| `layerwise_refreshed_tensors_total` | counter | tensors the repairs refreshed (summed over workers) |
| `layerwise_verify_failures_total` | counter | verifications that did not pass |
| `layerwise_weight_version{version}` | gauge | 1 for the version set with the last reload |
"""

from __future__ import annotations

from functools import cache

from layerwise_cli.worker import rpc

# Reloads of small models take well under a second; of large ones, minutes.
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@cache
def _metrics():
    """Created once per process, on first use (importing this module registers nothing)."""
    from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415 - prometheus_client: 0.13 s to import, server process only

    return {
        "reloads": Counter("layerwise_reloads", "layerwise reloads by result", ["result"]),
        "reload_seconds": Histogram("layerwise_reload_seconds", "Wall time of a layerwise reload inside the server",
                                    buckets=SECONDS_BUCKETS),
        "engine_stall_seconds": Histogram(
            "layerwise_engine_stall_seconds",
            "Seconds a layerwise reload held the engine core (no scheduler step ran), paused or not",
            buckets=SECONDS_BUCKETS),
        "pause_seconds": Histogram("layerwise_pause_seconds", "Seconds generation stayed paused under a lease",
                                   buckets=SECONDS_BUCKETS),
        "pause_drain_seconds": Histogram("layerwise_pause_drain_seconds",
                                         "Seconds of each pause spent letting in-flight requests finish (mode wait)",
                                         buckets=SECONDS_BUCKETS),
        "leases_expired": Counter("layerwise_pause_leases_expired",
                                  "Pause leases that ended because their client stopped renewing them"),
        "read_bytes": Counter("layerwise_read_bytes", "Checkpoint bytes read by layerwise reloads"),
        "skipped_layers": Counter("layerwise_skipped_layers", "Layers layerwise reloads left as they were"),
        "refreshed": Counter("layerwise_refreshed_tensors", "Tensors layerwise's repairs refreshed after reloads"),
        "verify_failures": Counter("layerwise_verify_failures", "layerwise verifications that did not pass"),
        "version": Gauge("layerwise_weight_version", "The weight version set with the last layerwise reload",
                         ["version"]),
    }


def record_call(method: str, engines: list[list], seconds: float) -> None:
    """Record one `/layerwise/engines_rpc` call of METHOD: its answers, one list per engine, in SECONDS."""
    answers = [answer for workers in engines for answer in workers if isinstance(answer, dict)]
    if method == rpc.RELOAD:
        _record_reload(answers, seconds)
    elif method == rpc.VERIFY:
        verified = [answer.get("verify") or {} for answer in answers]
        if not answers or any(not answer.get("ok") for answer in answers) or any(
                v.get("mismatched") or v.get("errors") for v in verified):
            _metrics()["verify_failures"].inc()


def _record_reload(answers: list[dict], seconds: float) -> None:
    metrics = _metrics()
    failed = [answer for answer in answers if not answer.get("ok")]
    if answers and not failed:
        result = "ok"
    elif failed and not any(answer.get("engine_touched") for answer in failed):
        result = "refused"  # before any weight changed (pre-flight)
    elif failed and all(answer.get("rolled_back") for answer in failed if answer.get("engine_touched")):
        result = "rolled_back"
    else:
        result = "failed"
    metrics["reloads"].labels(result=result).inc()
    metrics["reload_seconds"].observe(seconds)
    for answer in answers:
        report = answer.get("report") or {}
        metrics["read_bytes"].inc(report.get("read_bytes") or 0)
        metrics["skipped_layers"].inc(report.get("skipped_layers") or 0)
        metrics["refreshed"].inc(len(report.get("refreshed") or ()))


def record_stall(seconds: float) -> None:
    """A reload held the engine core SECONDS: no token was generated meanwhile. A data-parallel server's engines
    are held each for their own reload: the longest of them is recorded."""
    _metrics()["engine_stall_seconds"].observe(seconds)


def record_version(version: str) -> None:
    """The weight version the server now answers with (set with a reload)."""
    gauge = _metrics()["version"]
    gauge.clear()
    gauge.labels(version=version).set(1)


def record_pause(seconds: float, *, expired: bool, drain_s: float = 0.0) -> None:
    """A pause under a lease that lasted SECONDS, the first DRAIN_S of them letting the in-flight requests finish
    (mode `wait`: they were served, new ones held); EXPIRED: it ended because its client stopped renewing it."""
    metrics = _metrics()
    metrics["pause_seconds"].observe(seconds)
    metrics["pause_drain_seconds"].observe(drain_s)
    if expired:
        metrics["leases_expired"].inc()
