"""The `layerwise` weight-transfer backend's own logic: the update info, the init info, the one-line errors, the
registration, and the trainer engine's round (with a recording client: no server)."""

from __future__ import annotations

import pytest

from layerwise_cli.checkpoint.delta.read import delta_file
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.server.plugin import register
from layerwise_cli.server.weight_transfer.engine import LayerwiseInitInfo, LayerwiseWeightTransferEngine
from layerwise_cli.worker.rpc import ReloadOptions, TransferUpdate
from layerwise_cli.writer.trainer_engine import LayerwiseTrainerInitInfo, LayerwiseTrainerWeightTransferEngine


def test_update_info_round_trips_and_refuses_what_it_does_not_know() -> None:
    update = TransferUpdate("s3://b/run/step_2", ReloadOptions(allow_partial=True, revision="abc"), verify=True)
    sent = update.to_json()
    assert sent == {"source": "s3://b/run/step_2", "allow_partial": True, "revision": "abc", "verify": True}
    assert TransferUpdate.from_json(sent) == update
    assert TransferUpdate.from_json({"source": "org/repo"}) == TransferUpdate("org/repo")
    for bad, words in [
        ([], "must be a JSON object"),
        ({}, "needs a 'source'"),
        ({"source": "  "}, "needs a 'source'"),
        ({"source": "x", "verfy": True}, "unknown key(s) 'verfy'"),
        ({"source": "x", "progress_path": "/tmp/p"}, "unknown key(s) 'progress_path'"),  # this process's file
        ({"source": "x", "verify": "yes"}, "'verify' must be true or false"),
        ({"source": "x", "all_layers": 1}, "'all_layers' must be true or false"),
        ({"source": "x", "revision": 3}, "'revision' must be a string or null"),
        ({"source": "x", "order": None}, "'order' must be a string"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
            TransferUpdate.from_json(bad)
        assert "\n" not in str(err.value)


def test_an_engine_failure_is_answered_with_the_workers_own_line() -> None:
    from layerwise_cli.server.weight_transfer.routes import engine_failure_line  # noqa: PLC0415 - fastapi: heavy (test collection stays fast)

    line = "/ckpt/step_2: needs the engine to hold its base /ckpt/step_1, but it holds 'x'"
    # As the multiprocessing executor and the engine core's utility call wrap it, and as the in-process one does.
    wrapped = (f"Call to collective_rpc method failed: Worker failed with error '{line}', please check the stack "
               "trace above for the root cause")
    assert engine_failure_line(Exception(wrapped)) == line
    assert engine_failure_line(Exception(f"Call to collective_rpc method failed: {line}")) == line
    assert engine_failure_line(RuntimeError("two\nlines")) == "two lines"


@pytest.mark.slow
def test_init_info_refuses_unknown_keys_and_bad_leases() -> None:
    assert LayerwiseInitInfo.from_json({}).pause_lease_s == 60.0
    assert LayerwiseInitInfo.from_json({"pause_lease_s": 5}).pause_lease_s == 5.0
    for bad, words in [({"master_port": 1}, "unknown key"), ({"pause_lease_s": 0}, "pause_lease_s"),
                       ({"pause_lease_s": True}, "pause_lease_s"), ([], "JSON object")]:
        with pytest.raises(ValueError, match=words):
            LayerwiseInitInfo.from_json(bad)


@pytest.mark.slow
def test_the_plugin_registers_the_backend_with_both_of_vllms_factories() -> None:
    """What makes a plain `vllm serve` accept `--weight-transfer-config '{"backend": "layerwise"}'`: vLLM loads its
    general plugins in each of its processes, and layerwise's (the installed entry point) names the engines
    (imported only when vLLM builds one)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory  # noqa: PLC0415 - vllm: heavy (test collection stays fast)
    from vllm.plugins import load_general_plugins  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    load_general_plugins()  # as every vLLM process does: the `vllm.general_plugins` entry points
    assert "layerwise" in WeightTransferEngineFactory._registry
    register()  # idempotent: a process that loads it twice (`layerwise serve`, then the plugin)
    assert WeightTransferEngineFactory._registry["layerwise"]() is LayerwiseWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["layerwise"]() is LayerwiseTrainerWeightTransferEngine


class RecordingClient:
    """vLLM's `VLLMWeightSyncClient` protocol, recording each call (a fake of the server, for the round's order)."""

    def __init__(self, fail_update: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail_update = fail_update

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(("update", update_info))
        if self.fail_update:
            raise RuntimeError("400: refused")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def _tensors(step: int) -> dict:
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    gen = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16)
            for i in range(2)}
    base["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    for name in list(base)[:step - 1]:  # each step changes one more tensor, a few values
        base[name] = base[name].clone()
        base[name][0, :4] += 1
    return base


@pytest.mark.slow
def test_the_trainer_engine_writes_a_full_step_then_deltas_and_drives_start_update_finish(tmp_path) -> None:
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    client = RecordingClient()
    info = LayerwiseTrainerInitInfo(str(tmp_path / "run"), rank=0, update={"verify": True}, pause_lease_s=20)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    sent = [engine.send_weights(_tensors(step).items()) for step in (1, 2, 3)]
    assert [s.name for s in sent] == ["step_1", "step_2", "step_3"]
    assert [delta_file(s.source) is not None for s in sent] == [False, True, True]
    assert all((tmp_path / "run" / s.name / "STABLE").is_file() for s in sent)
    assert client.calls[0] == ("init", {"pause_lease_s": 20})
    for i, s in enumerate(sent):
        assert client.calls[1 + 3 * i:4 + 3 * i] == [
            ("start",), ("update", {"source": s.source, "verify": True}), ("finish", s.name)]
    named = engine.send_weights(_tensors(3).items(), weight_version="v-final")
    assert named.name == "v-final" and client.calls[-1] == ("finish", "v-final")


@pytest.mark.slow
def test_a_refused_update_ends_the_servers_update_and_raises(tmp_path) -> None:
    client = RecordingClient(fail_update=True)
    engine = LayerwiseTrainerWeightTransferEngine.trainer_init(LayerwiseTrainerInitInfo(str(tmp_path), rank=0),
                                                              client=client)
    with pytest.raises(RuntimeError, match="refused"):
        engine.send_weights(_tensors(1).items())
    assert [c[0] for c in client.calls] == ["init", "start", "update", "finish"]
    assert client.calls[-1] == ("finish", None)  # no version: the server keeps the one it had


@pytest.mark.slow
def test_trainer_init_info_refuses_bad_update_options_and_a_source_in_them(tmp_path) -> None:
    with pytest.raises(LayerwiseError, match="unknown key"):
        LayerwiseTrainerInitInfo(str(tmp_path), rank=0, update={"verfy": True})
    with pytest.raises(LayerwiseError, match="the source is the step itself"):
        LayerwiseTrainerInitInfo(str(tmp_path), rank=0, update={"source": "x"})
    non_sender = LayerwiseTrainerInitInfo(str(tmp_path), rank=1)
    client = RecordingClient()
    engine = LayerwiseTrainerWeightTransferEngine.trainer_init(non_sender, client=client)
    assert engine.send_weights(_tensors(1).items()) is None and client.calls == []  # only rank 0 drives the server
