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

import shutil
from pathlib import Path

import pytest

from tests.support.engine_support import assert_matches_fresh, fresh_state
from tests.support.hub_server import Fault, HubServer
from tests.support.in_process import start_here, stop_here
from tests.support.synthetic import SyntheticModel

pytestmark = pytest.mark.engine

REPO = "org/step"
MODEL = SyntheticModel(layers=4, hidden=512, heads=4, kv_heads=2, head_dim=128, intermediate=2048, vocab=128)
PROMPTS_PAIRS = [(3, 4), (2, 5), (9, 9), (7, 8), (1, 6), (4, 4), (8, 2), (6, 3)]


def prompts() -> list[str]:
    from layerwise_cli.demo import demo_prompt

    return [demo_prompt(a, b) for a, b in PROMPTS_PAIRS]


def tensors_of(seeds: dict[int, int], default: int) -> dict:
    """MODEL's tensors: decoder layer i drawn from seed `seeds.get(i, default)`, the rest from DEFAULT."""
    import re

    import torch

    out = {}
    for name, shape in MODEL.tensors():
        match = re.search(r"\.layers\.(\d+)\.", name)
        seed = seeds.get(int(match.group(1)), default) if match else default
        generator = torch.Generator().manual_seed(seed * 1000 + len(out))
        value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        out[name] = value.to(torch.bfloat16)
    return out


def write(folder: Path, tensors: dict, tokenizer: Path) -> Path:
    import json

    from layerwise_cli.writer.save import save_checkpoint

    save_checkpoint(tensors.items(), folder, max_shard_size=8 << 20, marker=None, allow_nonfinite=True)
    for path in tokenizer.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(path, folder / path.name)
    (folder / "config.json").write_text(json.dumps(MODEL.config()))
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def ckpts(demo_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-stream")
    tokenizer = demo_models["multiply"]
    return {"A": write(root / "A", tensors_of({}, 1), tokenizer),
            "B": write(root / "B", tensors_of({}, 2), tokenizer),
            "C": write(root / "C", tensors_of({0: 3}, 2), tokenizer),  # B with decoder layer 0 changed
            "D": write(root / "D", tensors_of({}, 4), tokenizer),
            "NaN": write(root / "NaN", with_nan(tensors_of({}, 1)), tokenizer)}  # A with NaN in the final norm


def with_nan(tensors: dict) -> dict:
    tensors["model.norm.weight"][0] = float("nan")
    return tensors


@pytest.fixture(scope="module")
def hub(ckpts, tmp_path_factory):
    """The loopback Hub, `main` on A, and huggingface_hub in this process (the engine's too) pointed at it."""
    from huggingface_hub import constants

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
def engine(hub):
    """An engine started on the Hub repo id itself: at the commit `main` named then (A)."""
    llm = start_here(REPO)
    yield llm
    stop_here(llm)


def checksums(llm) -> dict:
    from tests.support.engine_support import engine_state

    return engine_state(llm)["checksums"]


def assert_is_fresh(llm, checkpoint: Path) -> None:
    assert_matches_fresh(llm, checkpoint, prompts())
    want = fresh_state(checkpoint, prompts())
    got = checksums(llm)
    assert [name for name in want if got.get(name) != want[name]] == []


def reload_main(llm, hub: HubServer, folder: Path, **options) -> tuple[object, str]:
    import layerwise_cli

    commit = hub.move_ref(REPO, "main", folder)
    hub.reset_counts()
    return layerwise_cli.reload(llm, REPO, **options), commit


def test_a_failed_reload_goes_back_to_the_commit_the_engine_started_on(engine, on_hub, ckpts) -> None:
    from layerwise_cli.errors import LayerwiseError

    # The engine started on `org/step` when `main` named A; `main` now names a step with NaN in its last layer.
    with pytest.raises(LayerwiseError, match=f"rolled back to the weights of {REPO}@{on_hub.start_commit}"):
        reload_main(engine, on_hub, ckpts["NaN"])
    assert_is_fresh(engine, ckpts["A"])


def test_a_new_commit_is_fetched_once_and_lands_in_the_hub_cache(engine, on_hub, ckpts) -> None:
    from huggingface_hub import snapshot_download

    report, commit = reload_main(engine, on_hub, ckpts["B"])
    sent, total = on_hub.sent_for(".safetensors"), weight_bytes(ckpts["B"])
    assert report.placement.commit == commit
    assert sent <= 1.05 * total, f"sent {sent} bytes of a {total}-byte checkpoint"
    assert report.volume.fetched_bytes is not None and report.volume.fetched_bytes >= report.volume.bytes
    assert_is_fresh(engine, ckpts["B"])
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
    assert_is_fresh(engine, ckpts["C"])


def test_bytes_that_arrive_corrupted_fail_the_reload_and_the_engine_keeps_its_weights(engine, on_hub, ckpts) -> None:
    from layerwise_cli.errors import LayerwiseError

    before = checksums(engine)
    shard = sorted(ckpts["A"].glob("*.safetensors"))[-1].name
    on_hub.faults.append(Fault(shard, "corrupt", times=100))
    try:
        with pytest.raises(LayerwiseError, match=shard):
            reload_main(engine, on_hub, ckpts["A"])
    finally:
        on_hub.faults.clear()
    assert checksums(engine) == before
    assert_is_fresh(engine, ckpts["C"])


def test_bounded_disk_keeps_nothing_in_the_hub_cache(engine, on_hub, ckpts) -> None:
    from layerwise_cli.checkpoint.hub.pin import repo_cache_folder

    report, commit = reload_main(engine, on_hub, ckpts["D"], bounded_disk=True)
    assert report.placement.commit == commit
    assert_is_fresh(engine, ckpts["D"])
    import hashlib

    folder = repo_cache_folder(REPO)
    # The config and index read for the plan are small files of the cache; no weight file is there.
    assert list((folder / "snapshots" / commit).glob("*.safetensors")) == []
    for shard in ckpts["D"].glob("*.safetensors"):
        etag = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert list((folder / "blobs").glob(f"{etag}*")) == [], f"{shard.name} was kept in the Hub cache"
