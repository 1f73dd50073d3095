"""`--verify` as the user's process sees it: one result merged across workers, for engines and servers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from layerwise_cli.report.jsonable import jsonable


@dataclass(frozen=True)
class VerifyResult:
    """`--verify` on one engine or server, merged across its workers; built once, never changed.

    Each parent layer of SOURCE is loaded afresh into a private copy of the
    engine's layer and compared with the live layer, bit for bit.

    Attributes:
        ok: every layer matches, none failed to load or went unchecked (unless
            `unchecked_accepted`), and at least one was checked.
        checked: layers compared (modules derived from a layer included).
        matched: layers that match on every worker.
        tensors_compared: stored tensors compared, over all workers.
        kernels_compared: kernel read-backs compared (weights held only inside a kernel), over all workers.
        mismatched: the layers that differ, in stream order (a tuple).
        skipped: layers (or derived buffers) that could not be compared -> why. They fail `ok`
            unless the caller accepted unchecked layers (`--allow-unchecked`).
        errors: layers that could not be loaded alone -> why (these fail `ok`: nothing was proven).
        details: mismatched layer -> what differs.
        derived: modules not in SOURCE checked through the layer they share storage
            with (a tied head: `{"lm_head": "model.embed_tokens"}`), and buffers derived at load
            from a parameter (`{"model.layers.0.mixer.conv_weights": "model.layers.0.mixer.conv1d.weight"}`);
            counted in `checked`.
        unchecked_accepted: the caller accepted unchecked layers (`--allow-unchecked`): `skipped`
            does not fail `ok`, and the output says so next to the verdict.
        wall_s: seconds the check took, seen from the caller (a server stays paused meanwhile).
        quantized: layers quantized online in the engine, re-quantized from SOURCE with the engine's
            own method and compared bit for bit (weights and scales) -> the method; counted in `checked`.
    """

    ok: bool
    checked: int
    matched: int
    tensors_compared: int
    kernels_compared: int
    mismatched: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    quantized: dict[str, str] = field(default_factory=dict)
    unchecked_accepted: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mismatched", tuple(self.mismatched))

    def to_dict(self) -> dict:
        """JSON-ready: counts as integers, seconds as floats, lists for sequences."""
        return jsonable(asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> VerifyResult:
        """The result `to_dict` wrote (keys it does not know are ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def merge_verify(per_worker: list[dict], wall_s: float = 0.0, *, allow_unchecked: bool = False) -> VerifyResult:
    """Merge the workers' verify results: a layer matches only if it matches on every worker
    that holds it.

    Args:
        per_worker: each worker's `layerwise_verify` answer (`verify_against_source`'s dict).
        wall_s: seconds the check took, seen from the caller.
        allow_unchecked: layers that could not be compared do not fail the result.

    Returns:
        The merged result.
    """
    mismatched: list[str] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    details: dict[str, str] = {}
    derived: dict[str, str] = {}
    quantized: dict[str, str] = {}
    for rank, answer in enumerate(per_worker):
        quantized.update(answer.get("quantized", {}))
        suffix = f" (worker {rank})" if len(per_worker) > 1 else ""
        for layer in answer["layers"]:
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
        ok=not mismatched and not errors and (allow_unchecked or not skipped) and checked > 0,
        checked=checked,
        matched=checked - len(mismatched),
        tensors_compared=sum(w["tensors_compared"] for w in per_worker),
        kernels_compared=sum(w["kernels_compared"] for w in per_worker),
        mismatched=mismatched,
        skipped=skipped,
        errors=errors,
        details=details,
        derived=derived,
        wall_s=wall_s,
        quantized=quantized,
        unchecked_accepted=allow_unchecked and bool(skipped),
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
    if verify.skipped and not verify.unchecked_accepted:
        name, why = next(iter(verify.skipped.items()))
        more = f" and {len(verify.skipped) - 1} more" if len(verify.skipped) > 1 else ""
        return (f"--verify: {len(verify.skipped)} layer(s) could not be checked: {name}: {why}{more} "
                "(--allow-unchecked accepts them)")
    return "--verify: no layer of the source could be checked"
