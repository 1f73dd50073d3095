"""`--verify` as the user's process sees it: one result merged across workers, for engines and servers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VerifyResult:
    """`--verify` on one engine or server (merged across its workers)."""

    ok: bool
    checked: int
    matched: int
    tensors_compared: int
    kernels_compared: int
    mismatched: list[str] = field(default_factory=list)
    # Layers not compared: by design (partial source, attention) ...
    skipped: dict[str, str] = field(default_factory=dict)
    # ... or because loading the layer alone failed (these fail --verify: nothing was proven).
    errors: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    # Modules not in SOURCE checked through the layer they share storage with (a tied
    # head: {"lm_head": "model.embed_tokens"}); counted in `checked`.
    derived: dict[str, str] = field(default_factory=dict)
    # Seconds the check took, seen from the caller (a server stays paused meanwhile).
    wall_s: float = 0.0

    @classmethod
    def from_dict(cls, data: dict) -> VerifyResult:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def merge_verify(per_worker: list[dict]) -> VerifyResult:
    """Merge the workers' verify results: a layer matches only if it matches on every worker that holds it."""
    mismatched: list[str] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    details: dict[str, str] = {}
    derived: dict[str, str] = {}
    for rank, worker in enumerate(per_worker):
        suffix = f" (worker {rank})" if len(per_worker) > 1 else ""
        for layer in worker["layers"]:
            if layer.get("derived_from") and layer["status"] in ("match", "mismatch"):
                derived[layer["name"]] = layer["derived_from"]
            if layer["status"] == "mismatch":
                if layer["name"] not in mismatched:
                    mismatched.append(layer["name"])
                details[layer["name"]] = layer["detail"] + suffix
            elif layer["status"] == "skipped":
                skipped[layer["name"]] = layer["detail"]
            elif layer["status"] == "error":
                errors[layer["name"]] = layer["detail"] + suffix
    # Pipeline stages check different layers: a layer counts once, whichever ranks checked it.
    checked = len({layer["name"] for worker in per_worker for layer in worker["layers"]
                   if layer["status"] in ("match", "mismatch")})
    return VerifyResult(
        ok=not mismatched and not errors and checked > 0,
        checked=checked,
        matched=checked - len(mismatched),
        tensors_compared=sum(w["tensors_compared"] for w in per_worker),
        kernels_compared=sum(w["kernels_compared"] for w in per_worker),
        mismatched=mismatched,
        skipped=skipped,
        errors=errors,
        details=details,
        derived=derived,
    )


def verify_failure(verify: VerifyResult) -> str:
    """The one-line reason a verification failed, naming the layers."""
    if verify.mismatched:
        shown = ", ".join(verify.mismatched[:5])
        more = f" and {len(verify.mismatched) - 5} more" if len(verify.mismatched) > 5 else ""
        return (f"--verify: {len(verify.mismatched)} layer(s) differ from what the source must produce: "
                f"{shown}{more}")
    if verify.errors:
        name, why = next(iter(verify.errors.items()))
        more = f" and {len(verify.errors) - 1} more" if len(verify.errors) > 1 else ""
        return f"--verify: {len(verify.errors)} layer(s) could not be checked: {name} {why}{more}"
    return "--verify: no layer of the source could be checked"
