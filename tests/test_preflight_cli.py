"""`layerwise reload` refuses what the headers show is wrong, and every invalid option, before an engine starts."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli import reload_remote
from layerwise_cli.cli.app import app
from layerwise_cli.client.engine import in_process, session
from layerwise_cli.client.servers.api import RemoteOptions, ServerClient
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import parameter_kind, reshard

runner = CliRunner()


class EngineStarted(Exception):
    """Raised by the stand-in for `start_engine`: the command got as far as starting an engine."""


@pytest.fixture
def engine_starts(monkeypatch) -> list[str]:
    """Every call to `start_engine` is recorded and stopped, so no test here can start a real engine."""

    calls: list[str] = []

    def start_engine(model, options=None):
        calls.append(model)
        raise EngineStarted(model)

    monkeypatch.setattr(in_process, "start_engine", start_engine)
    return calls


def _wrong_shape(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8, dtype=tensors[key].dtype)
    return tensors


def _wrong_dtype(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    key = "model.norm.weight"
    tensors[key] = torch.zeros(tensors[key].shape, dtype=torch.int32)
    return tensors


def _extra(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    return tensors


def _typo(tensors):
    tensors["model.layers.1.mlp.gate_prj.weight"] = tensors.pop("model.layers.1.mlp.gate_proj.weight")
    return tensors


def _rotary_typo(tensors):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    # Not one of the rotary buffers vLLM drops (`rotary_emb.inv_freq`), so not skipped.
    tensors["model.layers.0.self_attn.rotary_emb.inv_frq"] = torch.zeros(32, dtype=torch.float32)
    return tensors


def _drop_v_proj(tensors):
    return {k: v for k, v in tensors.items() if "layers.1.self_attn.v_proj" not in k}


def _bad_header(folder: Path) -> None:
    shard = min(folder.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:9] = b"#"
    shard.write_bytes(bytes(data))


def _huge_header_length(folder: Path) -> None:
    shard = min(folder.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))


CASES = {
    "missing tensor": (_drop_v_proj, None, "missing 1 tensor(s) the engine needs: 'model.layers.1.self_attn.v_proj"),
    "wrong shape": (_wrong_shape, None, "has shape [64, 136], the engine expects [64, 128]"),
    "wrong dtype": (_wrong_dtype, None, "has dtype I32, the engine expects BF16"),
    "unknown tensor": (_extra, None, "unknown tensor 'model.layers.0.mlp.surprise.weight'"),
    "typo in a name": (_typo, None, "unknown tensor 'model.layers.1.mlp.gate_prj.weight'"),
    "typo in a rotary buffer's name": (_rotary_typo, None,
                                       "unknown tensor 'model.layers.0.self_attn.rotary_emb.inv_frq'"),
    "bad header": (None, _bad_header, "not valid JSON"),
    "header length beyond file": (None, _huge_header_length, "past the end of the file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_header_errors_are_reported_before_any_engine_starts(case, demo_models, tmp_path, engine_starts):
    transform, corrupt, message = CASES[case]
    bad = reshard(demo_models["add"], tmp_path / "bad", parameter_kind, transform=transform)
    if corrupt is not None:
        corrupt(bad)
    result = runner.invoke(app, ["reload", "--weights-path", str(bad), "--model", str(demo_models["multiply"])])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {bad}"), result.stderr
    assert message in lines[0]
    assert engine_starts == [] and "Starting vLLM" not in result.stderr


def test_allow_partial_passes_preflight_for_a_partial_checkpoint(demo_models, tmp_path, engine_starts):
    partial = reshard(demo_models["add"], tmp_path / "partial", parameter_kind, transform=_drop_v_proj)
    result = runner.invoke(app, ["reload", "--weights-path", str(partial), "--model", str(demo_models["multiply"]),
                                 "--allow-partial"])
    assert engine_starts == [str(demo_models["multiply"])]
    assert isinstance(result.exception, EngineStarted) or "EngineStarted" in result.stderr


def test_a_good_checkpoint_gets_as_far_as_the_engine(demo_models, engine_starts):
    result = runner.invoke(app, ["reload", "--weights-path", str(demo_models["add"]),
                                 "--model", str(demo_models["multiply"])])
    assert engine_starts == [str(demo_models["multiply"])], result.output


USAGE_ERRORS = {
    "demo --order": (["demo", "--order", "bogus"], "--order"),
    "reload --order": (["reload", "--weights-path", "W", "--order", "bogus"], "--order"),
    "reload --pause-mode": (["reload", "--weights-path", "W", "--url", "http://127.0.0.1:9", "--pause-mode",
                             "sometimes"], "--pause-mode"),
    "reload --dtype": (["reload", "--weights-path", "W", "--dtype", "bf16"], "--dtype"),
    "reload --max-model-len": (["reload", "--weights-path", "W", "--max-model-len", "-5"], "--max-model-len"),
    "reload --tensor-parallel-size": (["reload", "--weights-path", "W", "-tp", "0"], "--tensor-parallel-size"),
    "reload --memory-fraction": (["reload", "--weights-path", "W", "--memory-fraction", "-0.5"],
                                 "--memory-fraction"),
    "reload --top": (["reload", "--weights-path", "W", "--top", "-1"], "--top"),
    "reload --timeout": (["reload", "--weights-path", "W", "--url", "http://127.0.0.1:9", "--timeout", "-1"],
                         "--timeout"),
    "reload --url with engine options": (["reload", "--weights-path", "W", "--url", "http://127.0.0.1:9",
                                          "--max-model-len", "64"], "--max-model-len"),
    "inspect-order --mapping": (["inspect-order", "W", "--mapping", "guess"], "--mapping"),
    "inspect-order --max-buffer": (["inspect-order", "W", "--max-buffer", "-1GB"], "--max-buffer"),
    "reorder --mapping": (["reorder", "W", "D", "--mapping", "guess"], "--mapping"),
    "reorder --max-shard-size": (["reorder", "W", "D", "--max-shard-size", "-5GB"], "--max-shard-size"),
    "reorder --max-shard-size 0": (["reorder", "W", "D", "--max-shard-size", "0"], "--max-shard-size"),
    "serve --dtype": (["serve", "M", "--dtype", "fp33", "--dry-run"], "--dtype"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_invalid_option_values_are_usage_errors_before_anything_starts(case, engine_starts, monkeypatch):
    def no_sources(*args, **kwargs):
        raise AssertionError("sources were read before the options were checked")

    monkeypatch.setattr(session, "prepare_sources", no_sources)
    args, option = USAGE_ERRORS[case]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.stderr
    assert engine_starts == []


def test_unknown_quantization_is_a_usage_error_before_the_engine_starts(demo_models, engine_starts):
    # Checked against the installed vLLM's own list (importing it takes a few seconds, not an engine start).
    result = runner.invoke(app, ["reload", "--weights-path", str(demo_models["add"]), "--quantization", "fp3"])
    assert result.exit_code == 2, result.output
    assert "--quantization must be one of vLLM's methods" in result.stderr and "'fp3'" in result.stderr
    assert engine_starts == []


@pytest.mark.parametrize("flag, allowed", [([], False), (["--allow-nonfinite"], True)])
def test_allow_nonfinite_reaches_the_reload(flag, allowed, demo_models, monkeypatch):
    """In process: the flag is passed to the workers' reload (the engine tests prove what they do with it)."""
    calls: list = []

    def reload_workers(llm, source, options):
        calls.append(options)
        raise LayerwiseError("stopped here by the test", where=source)

    monkeypatch.setattr(in_process, "start_engine", lambda model, options=None: object())
    monkeypatch.setattr(in_process, "stop_engine", lambda llm: None)
    monkeypatch.setattr(in_process, "reload_workers", reload_workers)
    result = runner.invoke(app, ["reload", "--weights-path", str(demo_models["add"]), "--json", *flag])
    assert result.exit_code == 1 and "stopped here by the test" in result.stderr
    assert [call.allow_nonfinite for call in calls] == [allowed]


def test_allow_nonfinite_reaches_the_servers(monkeypatch):
    """With --url: the option travels in RemoteOptions, and from there in the worker call's kwargs."""
    seen: list[RemoteOptions] = []
    monkeypatch.setattr(reload_remote, "reload_servers",
                        lambda urls, source, options, on_event=None, atomic=None: seen.append(options) or [])
    runner.invoke(app, ["reload", "--weights-path", "W", "--url", "http://127.0.0.1:9", "--allow-nonfinite"])
    runner.invoke(app, ["reload", "--weights-path", "W", "--url", "http://127.0.0.1:9"])
    assert [options.reload.allow_nonfinite for options in seen] == [True, False]

    sent: list[dict] = []

    def collective_rpc(self, method, kwargs, short=False):
        sent.append(kwargs)
        return [{"ok": False, "error": "stopped here by the test", "engine_touched": False}]

    monkeypatch.setattr(ServerClient, "collective_rpc", collective_rpc)
    client = ServerClient("http://127.0.0.1:9")
    client.per_engine = False  # a server without `layerwise serve`'s per-engine endpoint: /collective_rpc
    for options in seen:
        with pytest.raises(Exception, match="stopped here by the test"):
            client.layerwise_reload("W", options)
    assert sent[0]["allow_nonfinite"] is True and "allow_nonfinite" not in sent[1]
