"""The reload, the prefix-cache reset and the version in one engine-core utility call (`server/versioned_rpc.py`),
and how `/layerwise/engines_rpc` uses it (`server/engines_rpc.py`): with fakes of vLLM's engine core and client."""

from __future__ import annotations

import asyncio
import sys
import time
import types

import pytest

from layerwise_cli import vllm_compat
from layerwise_cli.server import engines_rpc, versioned_rpc
from layerwise_cli.server.versioned_rpc import CORE_METHOD, rpc_then_version


class FakeCore:
    """vLLM's `EngineCore` as the method sees it: its calls are logged in order."""

    def __init__(self, results: list, *, reset_takes: bool = True) -> None:
        self.results = results
        self.reset_takes = reset_takes
        self.version = "old"
        self.calls: list[tuple] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, args, kwargs))
        return self.results

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return self.reset_takes

    def get_weight_version(self):
        return self.version

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))
        self.version = version


def test_the_call_then_the_reset_then_the_version():
    core = FakeCore([{"ok": True}, {"ok": True}])
    answer = rpc_then_version(core, "layerwise_reload", None, ["a"], {"k": 1}, "v2", True)
    assert [call[0] for call in core.calls] == ["collective_rpc", "reset_prefix_cache", "set_weight_version"]
    assert core.calls[0] == ("collective_rpc", "layerwise_reload", ("a",), {"k": 1})
    assert core.calls[1] == ("reset_prefix_cache", True)  # running requests recompute on the new weights
    held = answer.pop("engine_s")
    assert answer == {"results": [{"ok": True}, {"ok": True}], "previous": "old", "versioned": True,
                      "prefix_cache_reset": True}
    assert isinstance(held, float) and held >= 0


class SlowCore(FakeCore):
    """A core whose workers take WORKER_S and whose reset takes RESET_S (time.sleep: the engine core is held)."""

    worker_s, reset_s = 0.05, 0.03

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        time.sleep(self.worker_s)
        return super().collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        time.sleep(self.reset_s)
        return super().reset_prefix_cache(reset_running_requests, reset_connector)


@pytest.mark.parametrize("ok", [True, False])
def test_the_answer_says_how_long_the_engine_core_was_held(ok):
    """The workers' call and the reset both hold the core: its time covers both (a failed call: the call)."""
    answer = rpc_then_version(SlowCore([{"ok": ok}]), "layerwise_reload", None, [], {}, "v2", True)
    assert answer["engine_s"] >= (SlowCore.worker_s + SlowCore.reset_s if ok else SlowCore.worker_s)


@pytest.mark.parametrize("results", [[], [{"ok": True}, {"ok": False, "error": "x"}]])
def test_a_failed_worker_leaves_the_version_and_the_cache(results):
    core = FakeCore(results)
    answer = rpc_then_version(core, "layerwise_reload", None, [], {}, "v2", True)
    assert [call[0] for call in core.calls] == ["collective_rpc"]
    assert core.version == "old" and not answer["versioned"] and answer["prefix_cache_reset"] is None


def test_vllms_own_reload_answers_none_and_succeeds():
    core = FakeCore([None])
    answer = rpc_then_version(core, "reload_weights", None, [], {}, None, False)
    assert answer["versioned"] is False and answer["prefix_cache_reset"] is None
    assert [call[0] for call in core.calls] == ["collective_rpc"]


def test_a_reset_that_did_not_take_is_said():
    answer = rpc_then_version(FakeCore([{"ok": True}], reset_takes=False), "m", None, [], {}, None, True)
    assert answer["prefix_cache_reset"] is False


def test_add_to_engine_core_adds_the_method_where_the_engine_cores_module_is_loaded(monkeypatch):
    """Only in a process that imported vLLM's engine core (the engine core's own), and once. The real class's
    members are checked by `scripts/check_vllm_release.py` (`ENGINE_CORE`); servers run it."""
    module = types.ModuleType(vllm_compat.ENGINE_CORE.module)
    monkeypatch.delitem(sys.modules, module.__name__, raising=False)
    versioned_rpc.add_to_engine_core()  # not loaded here: nothing to patch, and nothing imported
    assert module.__name__ not in sys.modules

    class EngineCore(FakeCore):
        pass

    module.EngineCore = EngineCore
    monkeypatch.setitem(sys.modules, module.__name__, module)
    versioned_rpc.add_to_engine_core()
    method = getattr(EngineCore, CORE_METHOD)
    versioned_rpc.add_to_engine_core()
    assert getattr(EngineCore, CORE_METHOD) is method
    core = EngineCore([{"ok": True}])
    assert getattr(core, CORE_METHOD)("m", None, [], {}, "v", False)["versioned"] and core.version == "v"


class FakeClient:
    """vLLM's engine client of one engine core (`AsyncLLM` with `engine_core.call_utility_async`)."""

    def __init__(self, core: FakeCore | None, *, core_has_method: bool = True) -> None:
        self.core = core
        self.updates: list[str] = []
        self.resets = 0
        outer = self

        class EngineCore:
            async def call_utility_async(self, name, *args):
                if name != CORE_METHOD or not core_has_method:
                    raise RuntimeError(f"Call to {name} method failed: 'EngineCoreProc' object has no "
                                       f"attribute '{name}'")
                return rpc_then_version(outer.core, *args)

        self.engine_core = EngineCore()

    async def collective_rpc(self, method, timeout, args, kwargs):
        return self.core.collective_rpc(method, timeout, args, kwargs)

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.resets += 1
        return True

    async def update_weight_version(self, version):
        self.updates.append(version)
        self.core.version = version


def _run(client, version, reset):
    return asyncio.run(engines_rpc._versioned_call(client, ("m", None, (), {}), version, reset))


def test_one_engine_core_does_it_all_in_its_own_call():
    client = FakeClient(FakeCore([{"ok": True}]))
    answers = _run(client, "v2", True)
    assert answers[0]["versioned"] and answers[0]["prefix_cache_reset"] is True
    assert client.updates == [] and client.resets == 0 and client.core.version == "v2"


def test_an_engine_core_without_the_method_gets_the_calls_one_after_the_other():
    """vLLM started without layerwise's plugin in its engine core: the call, then the reset, then the version."""
    client = FakeClient(FakeCore([{"ok": True}]), core_has_method=False)
    answers = _run(client, "v2", True)
    assert answers == [{"results": [{"ok": True}], "prefix_cache_reset": True}]
    assert client.updates == ["v2"] and client.resets == 1


def test_without_the_method_a_failed_call_sets_nothing():
    client = FakeClient(FakeCore([{"ok": False}]), core_has_method=False)
    _run(client, "v2", True)
    assert client.updates == [] and client.resets == 0


def test_other_failures_of_the_utility_call_are_raised():
    client = FakeClient(FakeCore([{"ok": True}]))

    async def broken(name, *args):
        raise RuntimeError("Call to layerwise_rpc_then_version method failed: out of memory")

    client.engine_core.call_utility_async = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        _run(client, "v2", False)


def test_an_engine_that_failed_sends_the_others_back_to_their_version():
    """Data parallel: engine 0 took `v2`, engine 1's worker failed: engine 0 is named `old` again."""
    client = FakeClient(FakeCore([{"ok": True}]))
    answers = [rpc_then_version(client.core, "m", None, [], {}, "v2", False),
               rpc_then_version(FakeCore([{"ok": False}]), "m", None, [], {}, "v2", False)]
    assert client.core.version == "v2"
    asyncio.run(engines_rpc._version_back(client, answers))
    assert client.updates == ["old"] and client.core.version == "old"
