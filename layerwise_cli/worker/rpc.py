"""The worker's RPC surface: each extension method's name, its arguments and its answer, imported by both sides.

vLLM calls a worker method by its name (`LLM.collective_rpc(NAME, kwargs=...)`
in process, `POST /collective_rpc` over HTTP), so the client cannot import
the method it calls. Both sides import this module instead: the client sends
a call's `kwargs()` to its `method`, the extension (`worker/extension.py`)
answers with an answer's `to_json()`, and the client reads it back with
`from_json()`. Only JSON crosses: these dataclasses are its schema. Nothing
here imports torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from layerwise_cli.engine_defaults import delta_patch_disabled, fresh_buffers_forced, repairs_disabled

PING = "layerwise_ping"
RELOAD = "layerwise_reload"
CHECKSUMS = "layerwise_checksums"
FINGERPRINTS = "layerwise_fingerprints"
VERIFY = "layerwise_verify"
PREFLIGHT = "layerwise_preflight"
# The `layerwise` weight-transfer backend's last update on this worker (`server/weight_transfer/engine.py`): a
# `ReloadAnswer` (`{"ok": null}` before the first update).
UPDATE_REPORT = "layerwise_update_report"


@dataclass(frozen=True)
class PingCall:
    """Is the extension loaded? Answered by `PingAnswer`."""

    method: ClassVar[str] = PING

    def kwargs(self) -> dict[str, Any]:
        return {}


# How a reload's bytes arrive (`ReloadOptions.delivery`; the rule is `client/delivery.py`'s).
DELIVERIES = ("local", "download", "prefetch", "stream")


@dataclass(frozen=True)
class ReloadOptions:
    """How to reload: every option of a reload, the same name from the flag to the worker.

    Built once where a reload is asked for (the `reload` command in process and with `--url`, `watch`, the
    Python API's `layerwise_cli.reload`), sent to the workers as it is (`ReloadCall`, `to_json`) and read there
    by the reload's phases (`worker/reload/stream_reload.py`). A new option is a field here, its flag, and the
    code that uses it.

    Attributes:
        order: `layer` (this tool's plan) or `file` (vLLM's own read order, for comparison).
        allow_partial: accept a checkpoint that covers only some parameters (`--allow-partial`).
        readahead: read the next layer while the engine loads the current one (`--readahead/--no-readahead`).
        revision: what SOURCE is read at: for a Hub repo id a branch, tag or commit (`--revision`), which
            `pin_reload` replaces by its commit before any process reads it; for a URL the pin of its objects'
            ETags (`etags:<16 hex>`, `store.headers.store_pin`); None for a path. A *pin* is either identity.
        progress_path: a file the first worker appends one JSON line per completed layer to, for the
            command's progress bar.
        allow_nonfinite: load tensors holding NaN or Inf (`--allow-nonfinite`); by default a layer holding
            any is refused before it is handed over, and the layers already loaded rolled back.
        all_layers: hand every layer over, also those the engine already holds (`--all`); by default a layer
            whose source digest and state match this worker's record is skipped.
        allow_unchecked: keep a reload whose completion could not be shown (a layer vLLM could not load, a
            derived buffer left stale, a peak other than the prediction; noted in the report) instead of
            rolling it back (`--allow-unchecked`; with `--verify` it also accepts layers that could not be
            checked).
        repairs: False leaves what vLLM's reload leaves stale (the diagnostic switch `LAYERWISE_NO_REPAIRS`,
            `with_switches`).
        in_place: False has vLLM materialize every layer in fresh buffers (the diagnostic switch
            `LAYERWISE_FRESH_BUFFERS`, `with_switches`).
        bounded_disk: a Hub or URL source's tensors are fetched into private files deleted after the reload, and
            only those the reload hands over: nothing is kept in the Hub cache or the store cache (`--bounded-disk`).
        delta_base_check: a sparse delta (docs/deltas.md) loads only into an engine that holds its base; False
            rebuilds it whatever the engine holds, each tensor proved by the delta's digests as it is read, and
            patches in place only the layers proved to hold a step of its chain: what `watch`, a rollback and a
            fleet going back to a step held through a delta do (no flag).
        delivery: how the source's bytes arrive, decided once where the operation starts
            (`client/delivery.py`): `local`, `download` (fetched whole first), `prefetch` (fetched whole while an
            in-process engine starts) or `stream` (the workers fetch the ranges they hand over); None where no
            operation decided it (a direct worker call): a local path is read where it is, a remote one streamed.
        patch_in_place: a sparse delta's new values are written straight into the engine's tensors for the
            layers it keeps in checkpoint layout (`delta_patch`); False hands every changed layer to vLLM's
            reload, rebuilt from its base (the diagnostic switch `LAYERWISE_NO_DELTA_PATCH`, `with_switches`).
    """

    order: str = "layer"
    allow_partial: bool = False
    readahead: bool = True
    revision: str | None = None
    progress_path: str | None = None
    allow_nonfinite: bool = False
    all_layers: bool = False
    allow_unchecked: bool = False
    repairs: bool = True
    in_place: bool = True
    bounded_disk: bool = False
    delta_base_check: bool = True
    patch_in_place: bool = True
    delivery: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The options as sent: those every extension has always taken, the others only when not their default.

        An extension older than an option still takes a call that leaves it at its default.
        """
        sent: dict[str, Any] = {name: getattr(self, name) for name in _ALWAYS_SENT}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name not in _ALWAYS_SENT and value != item.default:
                sent[item.name] = value
        return sent

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReloadOptions:
        """The options a client sent; keys this version does not know (a newer client's) are left out."""
        known = {item.name for item in fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in known})

    def with_switches(self) -> ReloadOptions:
        """These options with the diagnostic switches set in this process's environment (`engine_defaults`).

        `LAYERWISE_NO_REPAIRS` turns `repairs` off, `LAYERWISE_FRESH_BUFFERS` turns `in_place` off and
        `LAYERWISE_NO_DELTA_PATCH` turns `patch_in_place` off, so that a server's workers, whose environment is
        the server's, do as the switch set here asks.
        """
        return replace(self, repairs=self.repairs and not repairs_disabled(),
                       in_place=self.in_place and not fresh_buffers_forced(),
                       patch_in_place=self.patch_in_place and not delta_patch_disabled())


# What every version of the extension takes: sent also at their defaults, as they always were.
_ALWAYS_SENT = ("order", "allow_partial", "readahead", "revision")


@dataclass(frozen=True)
class ReloadCall:
    """Reload SOURCE on every worker (`LayerwiseWorkerExtension.layerwise_reload`). Answered by `ReloadAnswer`.

    Attributes:
        source: a checkpoint directory or file the workers read, or a Hub repo id.
        options: how to reload (`ReloadOptions`), sent as its keyword arguments.
    """

    method: ClassVar[str] = RELOAD
    source: str
    options: ReloadOptions = ReloadOptions()

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments: SOURCE and the options' `to_json()`."""
        return {"source": self.source, **self.options.to_json()}


@dataclass(frozen=True)
class ChecksumsCall:
    """SHA-256 of every engine tensor that keeps storage, and their pointers. Answered by `ChecksumsAnswer`."""

    method: ClassVar[str] = CHECKSUMS

    def kwargs(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class FingerprintsCall:
    """A digest of what every module computes with. Answered by `FingerprintsAnswer`."""

    method: ClassVar[str] = FINGERPRINTS

    def kwargs(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class VerifyCall:
    """Check that the engine holds what SOURCE must produce. Answered by `VerifyAnswer`."""

    method: ClassVar[str] = VERIFY
    source: str
    revision: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"source": self.source, "revision": self.revision}


@dataclass(frozen=True)
class PreflightCall:
    """Would SOURCE reload cleanly, and what does the engine hold now? Nothing changes. Answered by `PreflightAnswer`.

    Attributes:
        source: a checkpoint directory or file the workers read, a Hub repo id, or a URL.
        revision: its pin: the commit of a Hub repo id, or a URL's `etags:<16 hex>` (as `ReloadOptions.revision`).
        allow_partial: accept a checkpoint that covers only some parameters.
        delta_base_check: as `ReloadOptions.delta_base_check`: False when the reload it checks rebuilds a delta
            whatever the engine holds (`watch`), so that the pre-flight does not refuse what the reload would load.
        allow_nonfinite: as `ReloadOptions.allow_nonfinite`: the step a pre-flight prepares is refused for a
            NaN or Inf value unless the reload would load it anyway.
    """

    method: ClassVar[str] = PREFLIGHT
    source: str
    revision: str | None = None
    allow_partial: bool = False
    # As `ReloadOptions.delta_base_check`: False for a reload that does not check a delta's base (`watch`).
    delta_base_check: bool = True
    allow_nonfinite: bool = False

    def kwargs(self) -> dict[str, Any]:
        found = {"source": self.source, "revision": self.revision, "allow_partial": self.allow_partial}
        # Each sent only when not the default: a server of an earlier version still answers the usual call.
        if not self.delta_base_check:
            found["delta_base_check"] = False
        if self.allow_nonfinite:
            found["allow_nonfinite"] = True
        return found


@dataclass(frozen=True)
class _Answer:
    """One worker's answer: `ok`, and on failure `error`; the JSON keys are the fields each outcome names."""

    ok: bool = False
    error: str | None = None

    # The fields a successful / a failed answer carries besides `ok` (the wire shape).
    ok_fields: ClassVar[tuple[str, ...]] = ()
    failure_fields: ClassVar[tuple[str, ...]] = ("error",)

    def to_json(self) -> dict[str, Any]:
        carried = self.ok_fields if self.ok else self.failure_fields
        return {"ok": self.ok, **{name: getattr(self, name) for name in carried}}

    @classmethod
    def from_json(cls, data: Any):
        """The answer a worker sent; anything but an object is a failed answer saying what came."""
        if not isinstance(data, dict):
            return cls(ok=False, error=f"the worker answered {data!r}, not an object")
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in data.items() if name in known})


@dataclass(frozen=True)
class PingAnswer(_Answer):
    """The extension's version, and this worker's rank, place (tp/pp/dp) and records."""

    version: str | None = None
    rank: int | None = None
    position: dict = field(default_factory=dict)
    engine_id: str | None = None
    recorded_layers: int = 0

    ok_fields: ClassVar[tuple[str, ...]] = ("version", "rank", "position", "engine_id", "recorded_layers")


@dataclass(frozen=True)
class ReloadAnswer(_Answer):
    """This worker's report (`ReloadReport.to_dict()`), or why it failed and what that left behind."""

    report: dict | None = None
    # Whether this worker's weights were touched, and put back.
    engine_touched: bool = False
    rolled_back: bool = False
    # The failure began on another rank; this one only followed.
    followed_another_rank: bool = False
    position: dict = field(default_factory=dict)
    traceback: str | None = None

    ok_fields: ClassVar[tuple[str, ...]] = ("report",)
    failure_fields: ClassVar[tuple[str, ...]] = ("error", "engine_touched", "rolled_back", "followed_another_rank",
                                                 "position", "traceback")


@dataclass(frozen=True)
class ChecksumsAnswer(_Answer):
    """Tensor name -> SHA-256, and tensor name -> storage pointer."""

    rank: int | None = None
    checksums: dict = field(default_factory=dict)
    pointers: dict = field(default_factory=dict)

    ok_fields: ClassVar[tuple[str, ...]] = ("rank", "checksums", "pointers")


@dataclass(frozen=True)
class FingerprintsAnswer(_Answer):
    """Module name -> fingerprint of what it computes with."""

    rank: int | None = None
    fingerprints: dict = field(default_factory=dict)

    ok_fields: ClassVar[tuple[str, ...]] = ("rank", "fingerprints")


@dataclass(frozen=True)
class VerifyAnswer(_Answer):
    """This worker's verification (`verify_against_source`'s dict, merged by `merge_verify`)."""

    rank: int | None = None
    verify: dict | None = None
    traceback: str | None = None

    ok_fields: ClassVar[tuple[str, ...]] = ("rank", "verify")
    failure_fields: ClassVar[tuple[str, ...]] = ("error", "traceback")


@dataclass(frozen=True)
class PreflightAnswer(_Answer):
    """SOURCE passed this worker's pre-flight; where the weights it holds came from, and whether that is still there.

    Attributes:
        loaded_from: the source (and revision) of the weights this worker holds now: its last completed
            reload, or the engine's model.
        back_error: why `loaded_from` could not be read again here (deleted, truncated), or None: a fleet
            still updates such a server, with a warning, and says so if it cannot reload it back.
        position: on failure, where the worker that refused sits (empty from an older worker).
    """

    rank: int | None = None
    notes: list = field(default_factory=list)
    loaded_from: str | None = None
    loaded_revision: str | None = None
    back_error: str | None = None
    # On failure: where the refusing worker sits (`RankPosition.to_dict`: rank, tp/pp/dp, its node when several).
    position: dict = field(default_factory=dict)

    ok_fields: ClassVar[tuple[str, ...]] = ("rank", "notes", "loaded_from", "loaded_revision", "back_error")
    failure_fields: ClassVar[tuple[str, ...]] = ("error", "position")


# The keys of an `update_info` besides `source` and the `ReloadOptions` fields.
_UPDATE_KEYS = ("verify",)
# `ReloadOptions` fields a caller of vLLM's weight-transfer API does not set: this process's progress file.
_UPDATE_HIDDEN = ("progress_path",)


@dataclass(frozen=True)
class TransferUpdate:
    """One `update_weights` of the `layerwise` backend of vLLM's weight-transfer API: what vLLM's route carries.

    vLLM's `POST /update_weights` hands its `update_info` object, unchanged, to
    the backend's engine in every worker (`server/weight_transfer/engine.py`);
    a trainer-side engine (`writer/trainer_engine.py`) builds it with
    `to_json`. Its keys: `source` (anything `reload --weights-path` takes), the
    `ReloadOptions` field names, and `verify`.

    Attributes:
        source: a checkpoint folder or file on the server's machine, a delta step, a Hub repo id (`revision`
            picks the commit), or a URL (`s3://...`, `https://...`).
        options: how to reload it (`ReloadOptions`).
        verify: after the reload, check every layer of the engine against SOURCE (`--verify`); a failed check
            rolls the engine back.
    """

    source: str
    options: ReloadOptions = ReloadOptions()
    verify: bool = False

    def to_json(self) -> dict[str, Any]:
        """The `update_info` object: `source`, the options that are not their default, `verify` when set."""
        sent = {item.name: getattr(self.options, item.name) for item in fields(ReloadOptions)
                if getattr(self.options, item.name) != item.default}
        return {"source": self.source, **sent, **({"verify": True} if self.verify else {})}

    @classmethod
    def from_json(cls, data: Any) -> TransferUpdate:
        """Read an `update_info` object; refuse a missing source, an unknown key or a value of the wrong type.

        Raises:
            ValueError: one line naming the key and what is wrong (vLLM answers the route with it).
        """
        if not isinstance(data, dict):
            raise ValueError(f"update_info must be a JSON object, not {type(data).__name__}")
        source = data.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ValueError("update_info needs a 'source': a checkpoint folder, a delta step, a Hub repo id or a "
                             "URL")
        defaults = {item.name: item.default for item in fields(ReloadOptions) if item.name not in _UPDATE_HIDDEN}
        unknown = sorted(set(data) - {"source", *_UPDATE_KEYS, *defaults})
        if unknown:
            raise ValueError(f"update_info: unknown key(s) {', '.join(map(repr, unknown))}; the keys are 'source', "
                             f"{', '.join(map(repr, (*defaults, *_UPDATE_KEYS)))}")
        for name, value in data.items():
            default = defaults.get(name, False if name in _UPDATE_KEYS else "")
            if not _same_kind(value, default):
                raise ValueError(f"update_info: {name!r} must be {_kind(default)}, not {value!r}")
        options = ReloadOptions(**{name: data[name] for name in defaults if name in data})
        return cls(source=source, options=options, verify=bool(data.get("verify", False)))


def _same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    return value is None or isinstance(value, str) if default is None else isinstance(value, type(default))


def _kind(default: Any) -> str:
    return "true or false" if isinstance(default, bool) else "a string or null" if default is None else "a string"
