"""vLLM's RL API with the `layerwise` backend, driven over HTTP as a framework drives it (TRL's routes).

One `layerwise serve` server for the module, started on the demo's *multiply* with
`--weight-transfer-config '{"backend": "layerwise"}'`, the loopback Hub, SeaweedFS and an HTTPS folder in its
environment. Two engines started fresh in this process, before it, on step A (*multiply*'s weights) and step B
(an RL-like step from A with some layers from *add*), are the references: after every update the server holds
what the fresh engine on that step holds, by every tensor (checksums), every module (fingerprints, which read
the CPU's packed linear kernels) and its answers.

- init, start, update, finish from a local step, a local delta step, a Hub step at its commit, an `s3://` step
  (with `verify`); `/weight_info` names each version, `/layerwise/update_report` holds each report;
  `/weight_checker` and `verify` agree (both say the engine holds A, both say it does not hold B);
- an `s3://` delta step (its base the step folder beside it in the bucket), equal to a fresh engine on B;
- bad input (a missing source, a delta against the wrong base, NaN, an object rewritten mid-update, an unknown
  key): an error status, one line naming the source and what is wrong; the engine keeps its weights;
- a client that dies between start and finish: the server serves again once the lease runs out;
- the trainer-side engine in a loop of three steps (deltas after the first), through vLLM's HTTP client.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from layerwise_cli.client.servers.api import ServerClient
from layerwise_cli.client.servers.reload_servers import server_fingerprints
from layerwise_cli.demo import demo_prompt
from layerwise_cli.writer.trainer_engine import LayerwiseTrainerInitInfo
from tests.support.deltas import save_step, write_steps
from tests.support.engine_support import load_tensors
from tests.support.https_server import HttpsFolder
from tests.support.hub_server import HubServer
from tests.support.in_process import start_here, stop_here
from tests.support.seaweed import BUCKET, running_seaweed
from tests.support.server_support import SMALL, RunningServer

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (0, 6)]
REPO = "org/rl-step"
BACKEND = ["--weight-transfer-config", json.dumps({"backend": "layerwise"})]


def prompts() -> list[str]:
    return [demo_prompt(a, b) for a, b in PAIRS]


def fresh_reference(checkpoint: Path) -> dict:
    """What an engine started fresh on CHECKPOINT answers and holds (it is stopped before this returns)."""
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    llm = start_here(str(checkpoint))
    try:
        outputs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        return {"answers": [o.outputs[0].text.strip() for o in outputs],
                "checksums": llm.collective_rpc("layerwise_checksums")[0]["checksums"],
                "fingerprints": llm.collective_rpc("layerwise_fingerprints")[0]["fingerprints"],
                "weight_checker": llm.collective_rpc("compute_weight_checksums")[0]}
    finally:
        stop_here(llm)


@pytest.fixture(scope="module")
def steps(demo_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rl-api-steps")
    steps = write_steps(root, demo_models)
    tensors = steps.pop("tensors")
    bad = {name: t.clone() for name, t in tensors.items()}
    norm = next(n for n in sorted(bad) if n.endswith("norm.weight") and ".layers." not in n)
    bad[norm][0] = float("nan")
    save_step(bad, root / "nan", steps["A"], allow_nonfinite=True)
    steps["NaN"] = root / "nan"
    return steps


@pytest.fixture(scope="module")
def fresh(steps) -> dict:
    """Fresh engines on A and B, in this process, before the server starts (never two engines at once)."""
    return {name: fresh_reference(steps[name]) for name in ("A", "B")}


@pytest.fixture(scope="module")
def hub(steps):
    with HubServer() as server:
        server.commit = server.add_repo(REPO, steps["B"])
        yield server


@pytest.fixture(scope="module")
def s3(steps):
    with running_seaweed() as server:
        # A run as a trainer uploads it: a delta's base is the step folder of its name beside it.
        server.put_folder(f"run/{steps['A'].name}", steps["A"])
        server.put_folder(f"run/{steps['AB'].name}", steps["AB"])
        yield server


@pytest.fixture(scope="module")
def https(steps, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl-api-https") / "B"
    shutil.copytree(steps["B"], folder)
    with HttpsFolder(folder) as server:
        yield server


@pytest.fixture(scope="module")
def server(demo_models, fresh, hub, s3, https, tmp_path_factory):
    env = {**s3.env(), "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path_factory.mktemp("rl-api-hf")),
           "SSL_CERT_FILE": str(https.ca_file)}
    with RunningServer(demo_models["multiply"], extra=[*SMALL, *BACKEND], env=env, start_timeout=600) as running:
        assert post(running, "/init_weight_transfer_engine", {"init_info": {"pause_lease_s": 30}}).status_code == 200
        yield running


def post(server: RunningServer, path: str, body: dict | None = None) -> httpx.Response:
    return server.http.post(f"{server.url}{path}", json=body, timeout=300)


def update(server: RunningServer, update_info: dict, version: str | None = None) -> httpx.Response:
    """start, update, finish (always, as a framework's `finally` does): the update's answer."""
    assert post(server, "/start_weight_update").status_code == 200
    try:
        return post(server, "/update_weights", {"update_info": update_info})
    finally:
        finished = post(server, "/finish_weight_update", {"weight_version": version} if version else None)
        assert finished.status_code in (200, 400), finished.text


def state(server: RunningServer) -> dict:
    rpc = post(server, "/collective_rpc", {"method": "layerwise_checksums"}).json()["results"][0]
    return {"answers": server.answers(PAIRS), "checksums": rpc["checksums"],
            "fingerprints": server_fingerprints(server.url)}


def assert_holds(server: RunningServer, reference: dict) -> None:
    got = state(server)
    assert got["answers"] == reference["answers"]
    assert [n for n in reference["checksums"] if got["checksums"].get(n) != reference["checksums"][n]] == []
    assert got["fingerprints"] == reference["fingerprints"]


def weight_version(server: RunningServer) -> str:
    return server.http.get(f"{server.url}/weight_info", timeout=30).json()["weight_version"]


def answered_by(server: RunningServer) -> str:
    """The weight version a completion's answer names (the `x-weight-versions` header)."""
    body = {"model": server.model, "prompt": prompts()[0], "max_tokens": 2, "temperature": 0.0}
    response = server.http.post(f"{server.url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.headers["x-weight-versions"]


def last_report(server: RunningServer) -> dict:
    answer = server.http.get(f"{server.url}/layerwise/update_report", timeout=60).json()
    assert answer["ok"], answer
    return answer["report"]


def test_every_kind_of_step_through_the_routes_ends_equal_to_a_fresh_engine(server, steps, fresh, hub, s3):
    assert fresh["A"]["answers"] != fresh["B"]["answers"]  # the steps tell apart by their answers too
    cases = [
        ("local", {"source": str(steps["B"])}, "B"),
        ("local-delta", {"source": str(steps["BA"])}, "A"),  # delta(B -> A): the server holds B by its records
        ("hub", {"source": REPO, "revision": hub.commit}, "B"),
        ("s3", {"source": f"s3://{BUCKET}/run/{steps['A'].name}", "verify": True}, "A"),
    ]
    for version, update_info, held in cases:
        answer = update(server, update_info, version)
        assert answer.status_code == 200, answer.text
        assert weight_version(server) == version
        assert not server.is_paused()  # the lease ended with finish
        assert answered_by(server) == version  # every answer names the weights that produced it
        report = last_report(server)
        assert report["source"] == update_info["source"] and report["layers"], report
        if update_info.get("verify"):
            assert report["verify"]["ok"] and report["verify"]["checked"] > 0, report["verify"]
        assert_holds(server, fresh[held])
    assert last_report(server)["fetched_bytes"] > 0  # read from the store by range


def test_weight_checker_and_verify_agree(server, steps, fresh):
    assert update(server, {"source": str(steps["A"])}, "A").status_code == 200
    for name, holds in (("A", True), ("B", False)):
        compared = post(server, "/weight_checker", {"action": "compare", "baseline": fresh[name]["weight_checker"]})
        assert compared.status_code == 200 and compared.json()["match"] is holds, compared.text
        client = ServerClient(server.url)
        try:
            verified = client.verify(str(steps[name]), None)
        finally:
            client.close()
        assert verified.ok is holds, verified


def test_a_delta_step_in_s3_ends_equal_to_a_fresh_engine(server, steps, fresh):
    assert update(server, {"source": str(steps["A"])}, "A").status_code == 200
    answer = update(server, {"source": f"s3://{BUCKET}/run/{steps['AB'].name}", "verify": True}, "s3-delta")
    assert answer.status_code == 200, answer.text
    assert weight_version(server) == "s3-delta"
    assert_holds(server, fresh["B"])


def test_bad_input_answers_one_line_and_the_engine_keeps_its_weights(server, steps, fresh, https):
    assert update(server, {"source": str(steps["A"])}, "A").status_code == 200
    shard = sorted(p.name for p in steps["B"].glob("*.safetensors"))[-1]
    https.rewrites[shard] = (steps["A"] / shard).read_bytes()  # the trainer rewrites it once the update pinned it
    missing = str(steps["A"].parent / "no-such-step")
    cases = [
        ({"source": missing}, missing, ""),
        ({"source": str(steps["BA"])}, str(steps["BA"]), "needs the engine to hold its base"),
        ({"source": str(steps["NaN"])}, str(steps["NaN"]), "NaN"),
        ({"source": https.url}, f"{https.url}/{shard}", "the object changed since"),
        ({"source": str(steps["B"]), "verfy": True}, "update_info", "unknown key(s) 'verfy'"),
        ({"verify": True}, "update_info", "needs a 'source'"),
    ]
    for update_info, where, what in cases:
        answer = update(server, update_info, "never")
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "\n" not in message and where in message and what in message, message
        assert weight_version(server) == "A"
        assert not server.is_paused()
        assert_holds(server, fresh["A"])
    assert https.rewrites == {}  # the rewrite happened mid-update


def test_a_client_that_dies_mid_update_leaves_the_server_serving_within_the_lease(server, steps, fresh):
    assert post(server, "/init_weight_transfer_engine", {"init_info": {"pause_lease_s": 2}}).status_code == 200
    try:
        assert post(server, "/start_weight_update").status_code == 200
        assert post(server, "/update_weights", {"update_info": {"source": str(steps["B"])}}).status_code == 200
        assert server.is_paused()
        # The client is gone: no finish. The lease runs out 2 s after its last call.
        deadline = time.monotonic() + 30
        while server.is_paused() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.is_paused()
        assert weight_version(server) != "never"
        assert_holds(server, fresh["B"])  # the last complete update, whole
        # The workers' update was ended with the lease: a new client starts one.
        assert update(server, {"source": str(steps["A"])}, "after-lease").status_code == 200
        assert_holds(server, fresh["A"])
    finally:
        post(server, "/init_weight_transfer_engine", {"init_info": {"pause_lease_s": 30}})


def test_the_trainer_engine_writes_deltas_and_the_server_ends_equal_to_a_fresh_engine(server, steps, fresh,
                                                                                     tmp_path):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    config = json.loads((steps["A"] / "config.json").read_text())
    info = LayerwiseTrainerInitInfo(str(tmp_path / "run"), rank=0, config=config, update={"verify": True},
                                    max_shard_size=60_000)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server.url))
    a, b = load_tensors(steps["A"]), load_tensors(steps["B"])
    try:
        for i, (tensors, held) in enumerate([(b, "B"), (a, "A"), (b, "B")], start=1):
            sent = engine.send_weights(tensors.items())
            assert sent.name == f"step_{i}" and sent.source == str(tmp_path / "run" / sent.name)
            assert (sent.saved.delta is not None) == (i > 1), sent.saved.fallback
            assert weight_version(server) == sent.name
            assert last_report(server)["verify"]["ok"]
            assert_holds(server, fresh[held])
    finally:
        engine.shutdown()


def test_the_trainer_engine_uploads_each_step_to_a_bucket_marker_last(server, steps, fresh, s3, tmp_path,
                                                                      monkeypatch):
    """Steps under `s3://`: written in the stage folder, uploaded, loaded by the server from the bucket (full
    steps: a server loads no delta from a bucket yet)."""
    import obstore  # noqa: PLC0415 - obstore: optional dependency (the storage extra)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    config = json.loads((steps["A"] / "config.json").read_text())
    info = LayerwiseTrainerInitInfo(f"s3://{BUCKET}/trained", rank=0, config=config, delta=False,
                                    stage=str(tmp_path / "stage"), max_shard_size=60_000)
    for key, value in s3.env().items():  # the trainer's credentials (the server has its own)
        monkeypatch.setenv(key, value)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server.url))
    for i, (step, held) in enumerate([("A", "A"), ("B", "B")], start=1):
        sent = engine.send_weights(load_tensors(steps[step]).items(), weight_version=f"bucket-{i}")
        assert sent.source == f"s3://{BUCKET}/trained/bucket-{i}" and sent.saved.delta is None
        listed = {item["path"] for batch in obstore.list(s3.objects(f"trained/bucket-{i}")) for item in batch}
        assert {"STABLE", "model.safetensors.index.json", "config.json"} <= listed
        assert weight_version(server) == f"bucket-{i}" and last_report(server)["fetched_bytes"] > 0
        assert_holds(server, fresh[held])
