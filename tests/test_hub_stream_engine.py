"""A Hub commit streamed into a real engine by byte range: each byte once, unchanged layers never, the cache after.

One engine in this process, started on the Hub repo id `org/step` itself while `main` named A (a Qwen3-shaped
checkpoint of 4 decoder layers, about 30 MB, written by `save_checkpoint` with header digests, the demo's
tokenizer), reloads `org/step` from the loopback Hub (`tests/support/hub_server.py`, LFS bytes from a second
origin) with the Python API as `main` moves. Each reload is proven against an engine started fresh on the same
checkpoint (every tensor, and answers), and the Hub server counts what it sent:

- NaN (A with NaN in its last layer): refused, and rolled back to the commit the engine started on, which
  `main` no longer names (the engine was started at that commit, not at the branch);
- B (every layer new): every weight byte is sent once, at most 1.05 x the checkpoint, and the shards land in
  the Hub cache, verified and linked, where an offline `snapshot_download` finds them;
- C (B with one of the four decoder layers changed): the layers the header digests skip are never fetched
  (only the spot check's sample windows), at most 0.30 x the checkpoint;
- A again, every byte arriving corrupted: the reload fails naming the file, and the engine keeps C;
- D with `bounded_disk`: nothing of it is kept in the Hub cache.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import layerwise_cli
from layerwise_cli.checkpoint.hub.pin import repo_cache_folder
from layerwise_cli.errors import LayerwiseError
from tests.support.engine_support import assert_is_fresh, checksums, fresh_state
from tests.support.hub_server import Fault, HubServer
from tests.support.in_process import start_here, stop_here
from tests.support.stream_steps import step_tensors, stream_prompts, write_step

pytestmark = pytest.mark.engine

REPO = "org/step"
def weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def ckpts(demo_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-stream")
    tokenizer = demo_models["multiply"]
    return {"A": write_step(root / "A", step_tensors({}, 1), tokenizer),
            "B": write_step(root / "B", step_tensors({}, 2), tokenizer),
            "C": write_step(root / "C", step_tensors({0: 3}, 2), tokenizer),  # B with decoder layer 0 changed
            "D": write_step(root / "D", step_tensors({}, 4), tokenizer),
            "NaN": write_step(root / "NaN", with_nan(step_tensors({}, 1)), tokenizer)}  # A with NaN in the final norm


def with_nan(tensors: dict) -> dict:
    tensors["model.norm.weight"][0] = float("nan")
    return tensors


@pytest.fixture(scope="module")
def hub(ckpts, tmp_path_factory):
    """The loopback Hub, `main` on A, and huggingface_hub in this process (the engine's too) pointed at it."""
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    server = HubServer(cdn=True)
    server.start_commit = server.add_repo(REPO, ckpts["A"])
    with server, pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "ENDPOINT", server.endpoint)
        patch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/"
                      "{filename}")
        patch.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hub-cache")))
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


@pytest.fixture
def on_hub(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.reset_counts()
    return hub


@pytest.fixture(scope="module")
def fresh(ckpts) -> None:
    """Engines started fresh on every step the tests compare with, before the engine under test starts: in this
    process (`start_here`), where one started beside it would start with processes of its own (30 s or more)."""
    for name in ("A", "B", "C", "D"):
        fresh_state(ckpts[name], stream_prompts())


@pytest.fixture(scope="module")
def engine(hub, fresh):
    """An engine started on the Hub repo id itself: at the commit `main` named then (A)."""
    llm = start_here(REPO)
    yield llm
    stop_here(llm)


def reload_main(llm, hub: HubServer, folder: Path, **options) -> tuple[object, str]:
    commit = hub.move_ref(REPO, "main", folder)
    hub.reset_counts()
    return layerwise_cli.reload(llm, REPO, **options), commit


def test_a_failed_reload_goes_back_to_the_commit_the_engine_started_on(engine, on_hub, ckpts) -> None:
    # The engine started on `org/step` when `main` named A; `main` now names a step with NaN in its last layer.
    with pytest.raises(LayerwiseError, match=f"rolled back to the weights of {REPO}@{on_hub.start_commit}"):
        reload_main(engine, on_hub, ckpts["NaN"])
    assert_is_fresh(engine, ckpts["A"], stream_prompts())


def test_a_new_commit_is_fetched_once_and_lands_in_the_hub_cache(engine, on_hub, ckpts) -> None:
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    report, commit = reload_main(engine, on_hub, ckpts["B"])
    sent, total = on_hub.sent_for(".safetensors"), weight_bytes(ckpts["B"])
    assert report.placement.commit == commit
    assert sent <= 1.05 * total, f"sent {sent} bytes of a {total}-byte checkpoint"
    assert report.volume.fetched_bytes is not None and report.volume.fetched_bytes >= report.volume.bytes
    assert_is_fresh(engine, ckpts["B"], stream_prompts())
    # Verified and linked: found offline at the commit, the same bytes, with no request.
    on_hub.reset_counts()
    folder = Path(snapshot_download(REPO, revision=commit, local_files_only=True, allow_patterns=["*.safetensors"]))
    for shard in ckpts["B"].glob("*.safetensors"):
        assert (folder / shard.name).read_bytes() == shard.read_bytes()
    assert on_hub.requests == []


def test_layers_the_header_digests_skip_are_never_fetched(engine, on_hub, ckpts) -> None:
    report, _ = reload_main(engine, on_hub, ckpts["C"])
    sent, total = on_hub.sent_for(".safetensors"), weight_bytes(ckpts["C"])
    assert report.unchanged.skipped_layers, "the unchanged layers were skipped"
    assert sent <= 0.30 * total, f"sent {sent} bytes of a {total}-byte checkpoint with one layer of four changed"
    assert_is_fresh(engine, ckpts["C"], stream_prompts())


def test_bytes_that_arrive_corrupted_fail_the_reload_and_the_engine_keeps_its_weights(engine, on_hub, ckpts) -> None:
    before = checksums(engine)
    shard = sorted(ckpts["A"].glob("*.safetensors"))[-1].name
    on_hub.faults.append(Fault(shard, "corrupt", times=100))
    try:
        with pytest.raises(LayerwiseError, match=shard):
            reload_main(engine, on_hub, ckpts["A"])
    finally:
        on_hub.faults.clear()
    assert checksums(engine) == before
    assert_is_fresh(engine, ckpts["C"], stream_prompts())


def test_bounded_disk_keeps_nothing_in_the_hub_cache(engine, on_hub, ckpts) -> None:
    report, commit = reload_main(engine, on_hub, ckpts["D"], bounded_disk=True)
    assert report.placement.commit == commit
    assert_is_fresh(engine, ckpts["D"], stream_prompts())
    folder = repo_cache_folder(REPO)
    # The config and index read for the plan are small files of the cache; no weight file is there.
    assert list((folder / "snapshots" / commit).glob("*.safetensors")) == []
    for shard in ckpts["D"].glob("*.safetensors"):
        etag = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert list((folder / "blobs").glob(f"{etag}*")) == [], f"{shard.name} was kept in the Hub cache"
