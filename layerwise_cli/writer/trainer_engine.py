"""The `layerwise` backend of vLLM's weight-transfer API, trainer side: each send writes a step and loads it.

For frameworks that drive vLLM's trainer engines (`WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)`, then `engine.send_weights()` each round). With `LayerwiseTrainerInitInfo` instead of
`NCCLTrainerInitInfo`, a round writes the trainer's tensors with `save_checkpoint` (a sparse delta against the
previous step where one exists) into the folder or URL prefix the init info names, then drives the server's
update with that step as the source: `start_weight_update`, `update_weights({"source": STEP, ...})`,
`finish_weight_update(STEP_NAME)`. The server (`--weight-transfer-config '{"backend": "layerwise"}'`) reads it
in layer order (`server/weight_transfer/engine.py`).

Importing this module registers the trainer engine with vLLM (the trainer's process loads no vLLM plugin); the
plugin registers it too (`server/plugin.py`), by name.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from layerwise_cli import WEIGHT_TRANSFER_BACKEND, vllm_compat, vllm_weight_transfer
from layerwise_cli.checkpoint.store.objects import is_store_url
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.rpc import TransferUpdate
from layerwise_cli.writer.save import SavedCheckpoint, save_checkpoint
from layerwise_cli.writer.step_upload import upload_step

_VllmTrainerEngine = vllm_compat.load(vllm_weight_transfer.TRAINER_WEIGHT_TRANSFER_ENGINE)
_VllmTrainerInitInfo = vllm_compat.load(vllm_weight_transfer.TRAINER_INIT_INFO)


@dataclass
class LayerwiseTrainerInitInfo(_VllmTrainerInitInfo):
    """Where the steps go and how the server loads them (what `NCCLTrainerInitInfo` is for the `nccl` backend).

    Attributes:
        steps: where each step is written: a folder the server can read (a shared filesystem), or a URL prefix
            (`s3://bucket/run`): the step `NAME` is `STEPS/NAME`.
        config: the model's config (a dict, or an object with `to_dict()`): written as each step's
            `config.json`, and what maps tensors to parent layers (`save_checkpoint`).
        update: `update_info` keys for every step besides `source` (`ReloadOptions` names and `verify`: `{"verify":
            true}`); checked when the init info is built.
        delta: write a step as a sparse delta against the previous one where it is smaller (the first step is full).
        stage: for a URL, the folder on this machine where steps are written before they are uploaded (the
            previous one stays as the next delta's base); None: a temporary folder.
        step_prefix: a step sent without a name is `{step_prefix}{n}`, n counting from 1.
        pause_lease_s: the server's pause lease (`init_info.pause_lease_s` of the inference side).
        max_shard_size: the most tensor bytes per shard of a full step.
    """

    backend: ClassVar[str] = WEIGHT_TRANSFER_BACKEND

    steps: str
    config: dict | None = None
    update: dict = field(default_factory=dict)
    delta: bool = True
    stage: str | None = None
    step_prefix: str = "step_"
    pause_lease_s: float = 60.0
    max_shard_size: int | None = None

    def __post_init__(self) -> None:
        if "source" in self.update:
            raise LayerwiseError("'update' names the options of every step: the source is the step itself",
                                 where="LayerwiseTrainerInitInfo")
        try:
            TransferUpdate.from_json({"source": self.steps, **self.update})
        except ValueError as exc:
            raise LayerwiseError(str(exc), where="LayerwiseTrainerInitInfo") from None


@dataclass(frozen=True)
class SentStep:
    """What one `send_weights` did: the step written and the source the server loaded.

    Attributes:
        name: the step's name (its weight version on the server).
        source: what the server loaded (`STEPS/NAME`).
        saved: what `save_checkpoint` wrote (`saved.delta`: the delta, or None for a full step).
    """

    name: str
    source: str
    saved: SavedCheckpoint


class LayerwiseTrainerWeightTransferEngine(_VllmTrainerEngine):
    """The `layerwise` trainer engine: `send_weights` writes a step, then has the server load it."""

    init_info_cls = LayerwiseTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True,
                 init_info: LayerwiseTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        if init_info is None:
            raise LayerwiseError("needs its LayerwiseTrainerInitInfo (build it with trainer_init)",
                                 where="layerwise trainer engine")
        self.init_info = init_info
        self.sent = 0
        self.previous: Path | None = None  # the last step written on this machine: the next delta's base
        self._stage = None

    @classmethod
    def trainer_init(cls, init_info: LayerwiseTrainerInitInfo, *, client, source=None):
        """Build the engine on every trainer rank; the sender initializes the server's side (its pause lease)."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({"pause_lease_s": init_info.pause_lease_s})
        return engine

    def send_weights(self, named_tensors=None, *, weight_version: str | None = None) -> SentStep | None:
        """Write this round's step and have the server load it; the server's version becomes the step's name.

        Args:
            named_tensors: (name, tensor) pairs in checkpoint names; None: the `source` given at `trainer_init`
                (a vLLM `WeightSource`, iterated on every rank: its gathers are collectives).
            weight_version: the step's name (None: `{step_prefix}{n}`).

        Returns:
            The step sent (None on a rank that is not the sender).

        Raises:
            LayerwiseError: the step could not be written or uploaded, or the server refused it (one line naming
                the step and what is wrong; the server keeps the weights it had).
        """
        tensors = named_tensors if named_tensors is not None else self._source_tensors()
        if not self.is_sender:
            for _ in tensors:  # stay in the trainer-side collectives
                pass
            return None
        self.sent += 1
        name = weight_version or f"{self.init_info.step_prefix}{self.sent}"
        folder, source = self._place(name)
        saved = self._save(tensors, folder)
        if is_store_url(self.init_info.steps):
            upload_step(folder, source, marker="STABLE")
        # The step just written is the next one's base (a delta's whole chain stays: its links rebuild it).
        self.previous = folder
        self._load(source, name)
        return SentStep(name=name, source=source, saved=saved)

    def _source_tensors(self):
        if self.source is None:
            raise LayerwiseError("no tensors: pass named_tensors, or a WeightSource to trainer_init",
                                 where="layerwise trainer engine")
        # vLLM 0.34's WeightSource iterates with iter_full(); 0.32's with iter().
        return self.source.iter_full() if hasattr(self.source, "iter_full") else iter(self.source)

    def _place(self, name: str) -> tuple[Path, str]:
        """Where step NAME is written on this machine, and the source the server reads it from."""
        steps = self.init_info.steps
        if not is_store_url(steps):
            folder = Path(steps) / name
            return folder, str(folder)
        if self._stage is None:
            self._stage = Path(self.init_info.stage or tempfile.mkdtemp(prefix="layerwise-steps-"))
        return self._stage / name, f"{steps.rstrip('/')}/{name}"

    def _save(self, tensors, folder: Path) -> SavedCheckpoint:
        base = self.previous if self.init_info.delta and self.previous is not None else None
        extra = {} if self.init_info.max_shard_size is None else {"max_shard_size": self.init_info.max_shard_size}
        marker = None if is_store_url(self.init_info.steps) else "STABLE"
        return save_checkpoint(tensors, folder, config=self.init_info.config, base=base, marker=marker, **extra)

    def _load(self, source: str, name: str) -> None:
        """Drive the server's update: start, update from SOURCE, finish with NAME as its version."""
        update = TransferUpdate.from_json({"source": source, **self.init_info.update}).to_json()
        self.client.start_weight_update()
        try:
            self.client.update_weights(update)
        except Exception:
            # End the server's update (its pause lease) now rather than when the lease runs out; the update's own
            # failure is what the caller needs.
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        self.client.finish_weight_update(name)

    def shutdown(self) -> None:
        """Remove a temporary stage folder (a URL's steps stay in the store)."""
        if self._stage is not None and self.init_info.stage is None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None


vllm_compat.register_weight_transfer(
    WEIGHT_TRANSFER_BACKEND, ("layerwise_cli.server.weight_transfer.engine", "LayerwiseWeightTransferEngine"),
    ("layerwise_cli.writer.trainer_engine", "LayerwiseTrainerWeightTransferEngine"))
