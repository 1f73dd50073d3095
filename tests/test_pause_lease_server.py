"""No pause outlives its client: `layerwise reload --url` SIGKILLed after each step, against real servers.

The client is a real `layerwise` process; `LAYERWISE_TEST_KILL_AFTER=STEP` (test-only) makes it SIGKILL itself
right after STEP. After each kill the server must answer completions again within the pause lease, and its
weight-version tag must name what it serves: the new tag where the answers are the new model's, the old one
where they are the old model's. Two kinds of server: `layerwise serve`, and vLLM's own server where layerwise
is installed (its vLLM plugin adds the lease; vLLM's own reload runs there, no layerwise extension). Without
the plugin (`VLLM_PLUGINS` leaves it out), the client says the server cannot promise this.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from layerwise_cli import ENGINES_RPC_PATH
from layerwise_cli.demo import demo_prompt, expected_answer
from layerwise_cli.worker import rpc
from tests.support.producers import Producer, save_pretrained_checkpoint
from tests.support.server_support import SMALL, RunningServer, run_cli

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (9, 9)]
LEASE_S = 4.0
# The steps of a reload over HTTP, in order; a kill after `pause` or later leaves a pause the lease must end.
STEPS = ("connect", "check", "pause", "reload", "verify", "version", "resume")
KILLED = -9


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


def weight_version(server: RunningServer) -> str:
    response = server.http.get(f"{server.url}/weight_info", headers=server.headers(), timeout=10)
    response.raise_for_status()
    return response.json()["weight_version"]


def serving_within(server: RunningServer, seconds: float) -> float:
    """Seconds until the server is unpaused (at most SECONDS, else the test fails)."""
    start = time.monotonic()
    while server.is_paused():
        assert time.monotonic() - start < seconds, f"{server.url} still paused after {seconds:g} s"
        time.sleep(0.2)
    return time.monotonic() - start


class Fleet:
    """A server on MULTIPLY and which model and tag it serves now, flipped by each reload that lands."""

    def __init__(self, server: RunningServer, models) -> None:
        self.server, self.models = server, models
        self.serving, self.version, self.count = "multiply", weight_version(server), 0

    def other(self) -> str:
        return "add" if self.serving == "multiply" else "multiply"

    def reload_killed_after(self, step: str, *args: str) -> tuple[str, str]:
        """Reload the other model, killed after STEP; return (model served, tag) once the server serves again."""
        self.count += 1
        tag = f"{self.other()}-{self.count}"
        proc = run_cli("reload", "--weights-path", str(self.models[self.other()]), "--url", self.server.url,
                       "--weight-version", tag, "--pause-lease", str(LEASE_S), *args,
                       env={"LAYERWISE_TEST_KILL_AFTER": step})
        assert proc.returncode == KILLED, (step, proc.returncode, proc.stderr[-2000:])
        serving_within(self.server, LEASE_S + 5)
        answers = self.server.answers(PAIRS)
        served = next(name for name in ("add", "multiply") if answers == expected(name))
        version = weight_version(self.server)
        if served != self.serving:
            self.serving, self.version = served, tag
        return served, version


@pytest.fixture(scope="module")
def layerwise_server(demo_models, tmp_path_factory):
    # The demo tokenizer has no chat template of its own: the server gets one, for the chat answers.
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    with RunningServer(demo_models["multiply"], kind="layerwise",
                       extra=[*SMALL, "--chat-template", str(template)]) as server:
        yield Fleet(server, demo_models)


@pytest.fixture(scope="module")
def plain_server_with_plugin(demo_models):
    with RunningServer(demo_models["multiply"], kind="plain") as server:
        yield Fleet(server, demo_models)


@pytest.mark.parametrize("step", STEPS)
def test_a_killed_client_leaves_layerwise_serve_serving_whole_weights_under_a_true_tag(layerwise_server, step):
    before = layerwise_server.serving
    served, version = layerwise_server.reload_killed_after(step, "--verify")
    # Killed before its reload was sent: the old weights; once the reload answered: the new ones.
    changed = step not in ("connect", "check", "pause")
    assert (served != before) == changed, (step, before, served)
    assert version == layerwise_server.version, (step, served, version)


@pytest.mark.parametrize("step", ("pause", "reload", "version"))
def test_a_killed_client_leaves_a_vllm_server_with_the_plugin_serving_under_a_true_tag(plain_server_with_plugin,
                                                                                      step):
    fleet = plain_server_with_plugin
    before = fleet.serving
    served, version = fleet.reload_killed_after(step)
    assert (served != before) == (step != "pause"), (step, before, served)
    assert version == fleet.version, (step, served, version)


def test_a_pause_past_its_lease_ends_by_itself_and_a_second_client_is_refused_meanwhile(layerwise_server):
    server = layerwise_server.server
    lease_s = 15.0  # longer than a client process takes to start
    held = server.http.post(f"{server.url}/layerwise/pause", params={"mode": "wait", "lease_s": lease_s}, timeout=30)
    assert held.status_code == 200, held.text
    began = time.monotonic()
    assert server.is_paused()
    second = run_cli("reload", "--weights-path", str(layerwise_server.models[layerwise_server.other()]), "--url",
                     server.url)
    assert time.monotonic() - began < lease_s, "the second client came too late to meet the lease"
    assert second.returncode == 1 and "already paused" in second.stderr, second.stderr[-2000:]
    assert "ends by itself" in second.stderr
    # A pause taken past that check (two clients at once) is refused by the server itself.
    racing = server.http.post(f"{server.url}/layerwise/pause", params={"mode": "wait", "lease_s": 5}, timeout=30)
    assert racing.status_code == 409 and "another client's lease" in racing.text
    serving_within(server, lease_s + 5)
    renew = server.http.post(f"{server.url}/layerwise/renew", params={"token": held.json()["token"], "lease_s": 5},
                       timeout=10)
    assert renew.status_code == 409 and "ran out" in renew.text
    assert server.answers(PAIRS) == expected(layerwise_server.serving)


def test_a_client_renews_its_lease_through_a_pause_longer_than_the_lease(layerwise_server):
    """A reload whose pause lasts longer than the lease (here: a 1 s lease, a reload with --verify) keeps it."""
    server, other = layerwise_server.server, layerwise_server.other()
    proc = run_cli("reload", "--weights-path", str(layerwise_server.models[other]), "--url", server.url,
                   "--verify", "--pause-lease", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pause lease ran out" not in proc.stdout + proc.stderr
    layerwise_server.serving = other
    assert server.answers(PAIRS) == expected(other)


def test_without_the_plugin_the_client_says_what_the_server_cannot_promise(demo_models):
    with RunningServer(demo_models["multiply"], kind="plain", env={"VLLM_PLUGINS": "layerwise_online_quant"}) as server:
        proc = run_cli("reload", "--weights-path", str(demo_models["add"]), "--url", server.url)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = " ".join(proc.stderr.split())  # as one line: the output wraps at the terminal's width
        assert "has no pause lease" in said and "stayed paused until POST /resume" in said, said
        assert server.http.post(f"{server.url}/layerwise/pause", params={"lease_s": 5}).status_code == 404


def _scrape(server: RunningServer) -> dict[tuple[str, tuple], float]:
    """Every sample of the server's /metrics: (name, sorted labels) -> value, parsed as Prometheus does."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415 - prometheus_client: heavy (test collection stays fast)

    text = server.http.get(f"{server.url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_count_reloads_pauses_bytes_and_the_version(layerwise_server, tmp_path):
    """/metrics (vLLM's endpoint, scraped and parsed) carries layerwise's own figures next to vLLM's."""
    server, other = layerwise_server.server, layerwise_server.other()
    before = _scrape(server)
    assert any(name.startswith("vllm:") for name, _ in before)  # vLLM's own, on the same endpoint
    done = run_cli("reload", "--weights-path", str(layerwise_server.models[other]), "--url", server.url,
                   "--weight-version", "metrics-1", "--all")
    assert done.returncode == 0, done.stderr[-2000:]
    layerwise_server.serving, layerwise_server.version = other, "metrics-1"
    # A reload refused inside the server (pre-flight: a checkpoint of another shape), nothing changed.
    foreign = save_pretrained_checkpoint(tmp_path / "qwen3", Producer("qwen3"), seed=1)
    refused = run_cli("reload", "--weights-path", str(foreign), "--url", server.url)
    assert refused.returncode == 1
    after = _scrape(server)

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert grew("layerwise_reloads_total", (("result", "ok"),)) == 1
    assert grew("layerwise_reloads_total", (("result", "refused"),)) == 1
    assert grew("layerwise_reload_seconds_count") == 2 and grew("layerwise_reload_seconds_sum") > 0
    assert grew("layerwise_pause_seconds_count") == 2
    # The drain is the first part of each pause: never longer than the pause it began.
    assert grew("layerwise_pause_drain_seconds_count") == 2
    assert 0 < grew("layerwise_pause_drain_seconds_sum") <= grew("layerwise_pause_seconds_sum")
    # Each reload held the engine core (no step ran) for part of its wall time in the server, paused or not.
    assert grew("layerwise_engine_stall_seconds_count") == 2
    assert 0 < grew("layerwise_engine_stall_seconds_sum") <= grew("layerwise_reload_seconds_sum")
    assert grew("layerwise_read_bytes_total") > 0
    assert after[("layerwise_weight_version", (("version", "metrics-1"),))] == 1
    assert not any(name == "layerwise_weight_version" and dict(labels).get("version") != "metrics-1" and value
                   for (name, labels), value in after.items())


def _answer(server: RunningServer, path: str = "/v1/completions", max_tokens: int = 40) -> httpx.Response:
    body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = demo_prompt(3, 4)
    else:
        body["messages"] = [{"role": "user", "content": demo_prompt(3, 4)}]
    response = server.http.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=120)
    response.raise_for_status()
    return response


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_answer_names_the_weights_that_produced_it(layerwise_server, path):
    server = layerwise_server.server
    response = _answer(server, path, max_tokens=5)
    spans = response.json()["weight_versions"]
    version = weight_version(server)
    assert [span["version"] for span in spans] == [version] and spans[0]["start"] == 0 and spans[0]["end"] == 5
    assert response.headers["x-weight-versions"] == version


def test_the_prefix_cache_reset_and_the_version_ride_with_the_workers_call(layerwise_server):
    """`/layerwise/engines_rpc` with a version and a reset: the engine core does both in the call's own utility
    call, and says whether the reset took; a call that fails inside a worker changes neither."""
    server = layerwise_server.server
    url = f"{server.url}{ENGINES_RPC_PATH}"
    body = {"method": rpc.PING, "kwargs": {}, "weight_version": "pinged", "reset_prefix_cache": True}
    answer = httpx.post(url, json=body, headers=server.headers(), timeout=60).json()
    assert answer["prefix_cache_reset"] is True and answer["one_step"] and answer["engines"][0][0]["ok"], answer
    assert weight_version(server) == "pinged"
    layerwise_server.version = "pinged"
    refused = {"method": rpc.VERIFY, "kwargs": {"source": "/nonexistent"}, "weight_version": "never",
               "reset_prefix_cache": True}
    answer = httpx.post(url, json=refused, headers=server.headers(), timeout=60).json()
    assert "prefix_cache_reset" not in answer and not answer["engines"][0][0]["ok"], answer
    assert weight_version(server) == "pinged"


@pytest.mark.parametrize("mode", ["keep", "wait", "none"])
def test_answers_across_a_reload_name_the_weights_that_produced_them(layerwise_server, mode):
    """Requests back to back from 8 threads while a reload runs, in each pause mode. Every answer names versions
    that are true: one naming only the old version is the old model's text, one naming only the new version the
    new model's (40 tokens, EOS ignored: each model's text is its own); its spans cover its tokens in order and
    agree with the header. In mode wait none names both (in-flight requests finish on the old weights).

    Mode none holds nothing, yet its answers are exact too: the engine core runs the reload, resets the prefix
    cache and sets the version in one utility call (`server/versioned_rpc.py`). With vLLM's own version call after
    the reload's, a token sampled between the two was the new weights' under the old version (seen once in a suite
    run: '1217' named the old version, whose text is '12')."""
    server, other = layerwise_server.server, layerwise_server.other()
    old, new = weight_version(server), f"{other}-{mode}"
    text_old = _answer(server).json()["choices"][0]["text"]
    answers: list[httpx.Response] = []
    done = threading.Event()

    def keep_asking() -> None:
        while not done.is_set():
            answers.append(_answer(server))

    threads = [threading.Thread(target=keep_asking) for _ in range(8)]
    for thread in threads:
        thread.start()
    proc = run_cli("reload", "--weights-path", str(layerwise_server.models[other]), "--url", server.url,
                   "--pause-mode", mode, "--weight-version", new)
    time.sleep(1.0)
    done.set()
    for thread in threads:
        thread.join()
    assert proc.returncode == 0, proc.stderr[-2000:]
    layerwise_server.serving, layerwise_server.version = other, new
    text_new = _answer(server).json()["choices"][0]["text"]
    assert text_old != text_new
    named = []
    for answer in answers:
        body = answer.json()
        spans = body["weight_versions"]
        versions = [span["version"] for span in spans]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == 40
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
        assert answer.headers["x-weight-versions"] == ",".join(versions)
        assert versions in ([old], [new], [old, new]), versions
        one_version = {(old,): text_old, (new,): text_new}.get(tuple(versions))
        if one_version is not None:
            assert body["choices"][0]["text"] == one_version, versions
        named.append(versions)
    # The traffic spanned the reload: answers from before it and after it.
    assert [old] in named and [new] in named, named
    if mode == "wait":
        assert [old, new] not in named
