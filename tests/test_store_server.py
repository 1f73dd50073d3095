"""`reload --url SERVER --weights-path s3://... --verify` for real: a `layerwise serve` server reads SeaweedFS.

The server (on the demo's dense *multiply*) gets the store's credentials and endpoint in its environment, as a
node would; the client pins the objects' ETags and hands the pin to it. It must answer as *add* afterwards,
and `--verify` (every layer compared with the step, read by range from the store) must pass. What the server
fetched stays in its store cache.
"""

from __future__ import annotations

import json

import pytest

from layerwise_cli.checkpoint.store.objects import store_cache_folder
from layerwise_cli.demo import expected_answer
from tests.support.seaweed import BUCKET, SECRET_KEY, running_seaweed
from tests.support.server_support import RunningServer, run_cli

pytestmark = pytest.mark.server

PAIRS = [(3, 4), (2, 5)]


def expected(name: str) -> list[str]:
    return [expected_answer(name, a, b) for a, b in PAIRS]


@pytest.fixture(scope="module")
def s3(demo_models):
    with running_seaweed() as server:
        server.put_folder("run/add", demo_models["add"])
        yield server


@pytest.fixture(scope="module")
def server(demo_models, s3):
    with RunningServer(demo_models["multiply"], env=s3.env(), start_timeout=600) as running:
        yield running


def test_reload_url_from_s3_with_verify(server, s3, demo_models, monkeypatch) -> None:
    url = f"s3://{BUCKET}/run/add"
    done = run_cli("reload", "--url", server.url, "--weights-path", url, "--verify", "--json", env=s3.env())
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["source"] == url and SECRET_KEY not in done.stdout + done.stderr
    result = report["servers"][0]
    assert result["ok"], result
    assert result["verify"]["ok"] and result["verify"]["checked"] > 0, result["verify"]
    assert server.answers(PAIRS) == expected("add")
    # What the server fetched is in its store cache (its environment's LAYERWISE_CACHE), each object whole.
    assert result["report"]["fetched_bytes"] > 0
    monkeypatch.setenv("LAYERWISE_CACHE", s3.env()["LAYERWISE_CACHE"])
    kept = sorted(p.stat().st_size for p in (store_cache_folder(url) / "blobs").iterdir() if p.is_file())
    assert kept == sorted(p.stat().st_size for p in demo_models["add"].glob("*.safetensors"))
