"""Our own logic around `--verify` and the derived-module rule, without an engine (fakes only here)."""

from __future__ import annotations

import pytest
import torch

from layerwise_cli import LayerwiseError
from layerwise_cli.client.engine.in_process import reload
from layerwise_cli.client.engine.session import reload_as
from layerwise_cli.report.verify_result import merge_verify, verify_failure
from layerwise_cli.worker.repairs.after_reload import derived_modules, repairs_disabled
from layerwise_cli.worker.rpc import ReloadOptions


class _Tied(torch.nn.Module):
    """A tiny model with a head tied by tensor, as vLLM's `tie_weights` does it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        # Shared as the same module object (multimodal wrappers, draft models): one module, never stale.
        self.alias = self.embed_tokens


def test_a_head_tied_by_tensor_is_derived_from_the_embedding():
    model = _Tied()
    assert derived_modules(model, {"embed_tokens"}) == {"lm_head": "embed_tokens"}
    # The other way round, too: whichever of the two a reload refilled is the origin.
    assert derived_modules(model, {"lm_head"}) == {"embed_tokens": "lm_head"}


def test_nothing_is_derived_without_shared_storage():
    model = _Tied()
    assert derived_modules(model, {"norm"}) == {}
    assert derived_modules(model, set()) == {}
    untied = _Tied()
    untied.lm_head.weight = torch.nn.Parameter(untied.embed_tokens.weight.detach().clone())
    assert derived_modules(untied, {"embed_tokens", "norm"}) == {}


def test_the_diagnostic_switch(monkeypatch):
    monkeypatch.delenv("LAYERWISE_NO_REPAIRS", raising=False)
    assert not repairs_disabled()
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "0")
    assert not repairs_disabled()
    monkeypatch.setenv("LAYERWISE_NO_REPAIRS", "1")
    assert repairs_disabled()


def test_the_diagnostic_switch_s_former_name_still_works_with_a_warning(monkeypatch):
    monkeypatch.delenv("LAYERWISE_NO_REPAIRS", raising=False)
    monkeypatch.setenv("LAYERWISE_NO_CPU_FIXUPS", "1")
    with pytest.warns(FutureWarning, match="LAYERWISE_NO_CPU_FIXUPS is deprecated .*LAYERWISE_NO_REPAIRS=1"):
        assert repairs_disabled()
    monkeypatch.setenv("LAYERWISE_NO_CPU_FIXUPS", "0")
    assert not repairs_disabled()


def _worker_verify(statuses: dict[str, str], derived_from: dict[str, str] | None = None) -> dict:
    layers = [{"name": name, "status": status, "detail": f"{name} {status}", "compared": ["weight", "#kernel"],
               **({"derived_from": derived_from[name]} if derived_from and name in derived_from else {})}
              for name, status in statuses.items()]
    checked = sum(1 for s in statuses.values() if s in ("match", "mismatch"))
    return {"layers": layers, "checked": checked, "matched": sum(1 for s in statuses.values() if s == "match"),
            "tensors_compared": checked, "kernels_compared": checked}


class _FakeLLM:
    """Answers the two worker methods `reload(..., verify=True)` calls, as two workers would."""

    def __init__(self, verify_statuses: list[dict[str, str]]) -> None:
        self.verify_statuses = verify_statuses
        self.calls: list[str] = []
        calls = self.calls

        class EngineCore:  # the engine-core client (`SyncMPClient`): pause and resume around the reload
            def call_utility(self, method: str, *args) -> None:
                calls.append(method)

        self.llm_engine = type("LLMEngine", (), {"engine_core": EngineCore()})()

    def collective_rpc(self, method: str, kwargs: dict):
        self.calls.append(method)
        if method == "layerwise_reload":
            report = {"order": "layer", "source": kwargs["source"], "wall_s": 0.1, "bytes": 10, "tensors": 2,
                      "peak_buffer_bytes": 5, "peak_tensor": "x", "predicted_peak_buffer_bytes": 5,
                      "largest_layer_bytes": 5, "layers": []}
            return [{"ok": True, "report": report} for _ in self.verify_statuses]
        if method == "layerwise_verify":
            return [{"ok": True, "verify": _worker_verify(s, {"lm_head": "model.embed_tokens"})}
                    for s in self.verify_statuses]
        raise AssertionError(method)

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


def test_reload_with_verify_returns_the_verification():
    llm = _FakeLLM([{"model.embed_tokens": "match", "lm_head": "match"}] * 2)
    report = reload(llm, "/ckpt/B", verify=True)
    assert llm.calls == ["pause_scheduler", "layerwise_reload", "resume_scheduler", "reset_prefix_cache",
                         "layerwise_verify"]
    assert report.verify.ok and report.verify.checked == 2 and report.verify.derived == {
        "lm_head": "model.embed_tokens"}
    assert report.to_dict()["verify"]["ok"] is True
    assert type(report).from_dict(report.to_dict()).verify == report.verify


def test_reload_with_verify_raises_naming_the_layer_a_worker_disagrees_on():
    llm = _FakeLLM([{"model.embed_tokens": "match", "lm_head": "match"},
                    {"model.embed_tokens": "match", "lm_head": "mismatch"}])
    with pytest.raises(LayerwiseError) as caught:
        reload(llm, "/ckpt/B", verify=True)
    message = str(caught.value)
    assert message.startswith("/ckpt/B: --verify: 1 layer(s) differ from what the source must produce: lm_head")
    assert "unverified" in message and "\n" not in message


def test_reload_without_verify_does_not_verify():
    llm = _FakeLLM([{"lm_head": "mismatch"}])
    assert reload(llm, "/ckpt/B").verify is None
    assert "layerwise_verify" not in llm.calls


def test_a_layer_that_could_not_be_checked_fails_verify():
    result = merge_verify([_worker_verify({"model.layers.0.mlp.gate": "error", "model.norm": "match"})])
    assert not result.ok and "model.layers.0.mlp.gate" in result.errors
    assert verify_failure(result).startswith("--verify: 1 layer(s) could not be checked: model.layers.0.mlp.gate")


def test_reload_as_names_the_source_as_given_and_carries_a_failed_verification(tmp_path):
    """The command's reload: the report is built once, under the user's name, with the verification in it."""
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    verifying: list[str] = []
    llm = _FakeLLM([{"model.embed_tokens": "match", "lm_head": "mismatch"}])
    report = reload_as(llm, "/cache/snapshots/abc", "org/model", ReloadOptions(progress_path=str(progress)),
                       verify=True, on_verify=lambda: verifying.append("now"))
    assert llm.calls == ["pause_scheduler", "layerwise_reload", "resume_scheduler", "reset_prefix_cache",
                         "layerwise_verify"] and verifying == ["now"]
    assert report.placement.source == "org/model"  # the workers read "/cache/snapshots/abc"
    assert report.verify is not None and not report.verify.ok and report.verify.mismatched == ("lm_head",)
    assert report.verify.wall_s > 0
    assert not progress.exists()
    quiet = reload_as(_FakeLLM([{"lm_head": "match"}]), "/ckpt/B", "B", ReloadOptions())
    assert quiet.placement.source == "B" and quiet.verify is None


def test_the_engine_is_resumed_when_the_reload_call_itself_fails():
    """`reload` pauses the engine (caches cleared) for the workers' reload, and resumes it whatever happens."""
    class Failing(_FakeLLM):
        def collective_rpc(self, method: str, kwargs: dict):
            self.calls.append(method)
            raise RuntimeError("the engine core died")

    llm = Failing([{"model.embed_tokens": "match"}])
    with pytest.raises(RuntimeError, match="engine core died"):
        reload(llm, "/ckpt/B")
    assert llm.calls == ["pause_scheduler", "layerwise_reload", "resume_scheduler"]
