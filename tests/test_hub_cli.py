"""Hub sources for real: huggingface_hub talks to a loopback Hub (tests/hub_server.py) via HF_ENDPOINT."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerwise_cli.cli.app import app
from layerwise_cli.errors import describe_exception
from tests.support.hub_server import HubServer
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

# Big enough that the headers are a small part of each shard.
DENSE = SyntheticModel(layers=3, hidden=128, intermediate=256, vocab=256)
MOE = SyntheticModel(layers=2, hidden=64, experts=4, moe_intermediate=64)

# Count the bytes the process reads from .safetensors files, printed at exit.
_COUNT_READS = """
import atexit, builtins, sys
_open, _read = builtins.open, [0]
class _Counted:
    def __init__(self, f): self._f = f
    def __getattr__(self, name): return getattr(self._f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): return self._f.__exit__(*exc)
    def read(self, *args):
        data = self._f.read(*args)
        _read[0] += len(data)
        return data
def _counting_open(file, *args, **kwargs):
    f = _open(file, *args, **kwargs)
    return _Counted(f) if str(file).endswith(".safetensors") else f
builtins.open = _counting_open
atexit.register(lambda: sys.stderr.write(f"\\nSAFETENSORS_BYTES_READ {_read[0]}\\n"))
"""


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-repos")
    folders = {
        "dense": root / "dense", "moe": root / "moe", "single": root / "single",
        "broken-index": root / "broken-index", "no-weights": root / "no-weights", "corrupt": root / "corrupt",
        "bare": root / "bare",
    }
    write_checkpoint(folders["dense"], DENSE, "trainer_export", 4)
    write_checkpoint(folders["moe"], MOE, "experts_spread", 3)
    write_checkpoint(folders["single"], DENSE, "in_order", 1)
    write_checkpoint(folders["broken-index"], DENSE, "in_order", 3)
    (folders["broken-index"] / "model-00002-of-00003.safetensors").unlink()
    folders["no-weights"].mkdir()
    (folders["no-weights"] / "config.json").write_text(json.dumps(DENSE.config()))
    folders["bare"].mkdir()
    write_safetensors(folders["bare"] / "model.safetensors", [("encoder.blocks.0.proj.weight", "F32", (64, 64))])
    folders["corrupt"].mkdir()
    (folders["corrupt"] / "config.json").write_text(json.dumps(DENSE.config()))
    (folders["corrupt"] / "model.safetensors").write_bytes(b"\x06\x00\x00\x00\x00\x00\x00\x00{oops}" + bytes(64))
    return folders


@pytest.fixture(scope="module")
def hub(repos: dict[str, Path]) -> Iterator[HubServer]:
    server = HubServer()
    server.add_repo("org/model", repos["dense"])
    server.add_repo("org/model", repos["moe"], revision="v2")
    for name in ("single", "broken-index", "no-weights", "corrupt", "bare"):
        server.add_repo(f"org/{name}", repos[name])
    server.add_repo("org/down", repos["dense"])
    server.failing["org/down"] = 500
    with server:
        yield server


@pytest.fixture
def hub_env(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """The loopback Hub as HF_ENDPOINT for subprocesses, with fresh counts."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.reset_counts()
    return hub


def layerwise(*args: str, env: dict[str, str] | None = None, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter: huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE at import."""
    code = textwrap.dedent(prelude) + "\nimport sys\nfrom layerwise_cli.cli.app import main\n" \
        f"sys.argv = ['layerwise', *{list(args)!r}]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


def local_json(folder: Path) -> dict:
    result = CliRunner().invoke(app, ["inspect-order", str(folder), "--json", "--top", "0"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def without_source(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in {"source", "kind", "revision", "commit"}}


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


def header_sizes(folder: Path) -> int:
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("*.safetensors"))


def data_sizes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_hub_repo_matches_local_and_sends_no_tensor_data(hub_env: HubServer, repos: dict[str, Path]) -> None:
    proc = layerwise("inspect-order", "org/model", "--json", "--top", "0")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["source"], data["kind"], data["revision"]) == ("org/model", "hub", None)
    assert data["commit"] == hub_env.resolve("org/model", "main").commit  # the commit every request named
    assert local_json(repos["dense"])["commit"] is None
    assert without_source(data) == without_source(local_json(repos["dense"]))
    # The server's own count: the shards' 8-byte prefixes and headers, nothing else.
    sent = hub_env.sent_for(".safetensors")
    assert sent == header_sizes(repos["dense"]) == data["header_bytes_read"]
    assert sent < 0.05 * data_sizes(repos["dense"])
    shard_requests = [r for r in hub_env.requests if r.path.endswith(".safetensors")]
    assert shard_requests and all(r.method == "GET" and r.range and r.status == 206 for r in shard_requests)
    assert hub_env.sent_for("config.json") > 0  # the architecture comes from config.json


def test_revision_branch_and_commit(hub_env: HubServer, repos: dict[str, Path]) -> None:
    proc = layerwise("inspect-order", "org/model", "--revision", "v2", "--json", "--top", "0")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["revision"] == "v2" and data["mapping"]["architecture"] == "Qwen3MoeForCausalLM"
    assert without_source(data) == without_source(local_json(repos["moe"]))
    # One request names v2 (the pin); every later one names the commit it resolved to.
    commit = hub_env.resolve("org/model", "v2").commit
    assert data["commit"] == commit
    resolves = [r.path for r in hub_env.requests if "/resolve/" in r.path]
    assert "/resolve/v2/" in resolves[0] and all(f"/resolve/{commit}/" in path for path in resolves[1:])
    table = layerwise("inspect-order", "org/model", "--revision", "v2", "--top", "1", env={"COLUMNS": "200"})
    assert f"org/model @ v2 (commit {commit})" in table.stdout
    by_commit = layerwise("inspect-order", "org/model", "--revision", commit, "--json", "--top", "0")
    assert by_commit.returncode == 0, by_commit.stderr
    assert without_source(json.loads(by_commit.stdout)) == without_source(data)


def test_single_file_repo(hub_env: HubServer, repos: dict[str, Path]) -> None:
    proc = layerwise("inspect-order", "org/single", "--json", "--top", "0")
    assert proc.returncode == 0, proc.stderr
    assert without_source(json.loads(proc.stdout)) == without_source(local_json(repos["single"]))
    assert hub_env.sent_for(".safetensors") == header_sizes(repos["single"])
    # No config.json and no index: the single file, planned with the generic mapping.
    bare = layerwise("inspect-order", "org/bare", "--json")
    assert bare.returncode == 0, bare.stderr
    data = json.loads(bare.stdout)
    assert data["mapping"]["kind"] == "generic" and data["tensors"] == 1 and data["total_bytes"] == 64 * 64 * 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["org/model", "--revision", "nope"], "Error: org/model@nope: revision not found on the Hub"),
        (["org/missing"], "Error: org/missing: repo not found on the Hub (or not visible with this token)"),
        (["org/broken-index"], ("Error: org/broken-index/model.safetensors.index.json: index names shard "
                                "'model-00002-of-00003.safetensors', which is not in the repo")),
        (["org/no-weights"], "Error: org/no-weights: no model.safetensors or model.safetensors.index.json in the repo"),
        (["org/corrupt"], "Error: org/corrupt/model.safetensors: header is not valid JSON (JSONDecodeError)"),
        (["org/down"], "Error: org/down/model-00001-of-00004.safetensors: Hub request failed: Server error '500 "),
    ],
    ids=["revision", "repo", "index-shard", "no-weights", "corrupt-header", "server-error"],
)
def test_hub_errors_are_one_line(hub_env: HubServer, args: list[str], expected: str) -> None:
    assert one_error_line(layerwise("inspect-order", *args)).startswith(expected)


def test_a_vanished_commit_is_one_line_naming_repo_and_commit(hub_env: HubServer, repos: dict[str, Path]) -> None:
    """A commit force-pushed away: `reload` says so in one line naming repo and commit, before any engine starts."""
    gone = hub_env.move_ref("org/forced", "main", repos["dense"])
    hub_env.forget_commit("org/forced", gone)
    line = one_error_line(layerwise("reload", "--weights-path", "org/forced", "--revision", gone,
                                    "--model", str(repos["dense"])))
    assert f"org/forced@{gone}" in line and "no longer on the Hub" in line, line


def test_storage_redirects_are_followed(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The Hub answers /resolve/ of a weight file with a 302 to its storage; the
    # range requests must follow it and still fetch only the headers.
    server = HubServer(redirect_lfs=True)
    server.add_repo("org/model", repos["dense"])
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        proc = layerwise("inspect-order", "org/model", "--json", "--top", "0")
        assert proc.returncode == 0, proc.stderr
        assert without_source(json.loads(proc.stdout)) == without_source(local_json(repos["dense"]))
        statuses = {(r.path.split("/")[1], r.status) for r in server.requests if r.path.endswith(".safetensors")}
        assert statuses == {("org", 302), ("cdn", 206)}
        assert server.sent_for(".safetensors") == header_sizes(repos["dense"])


def test_a_server_that_ignores_ranges_is_refused(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    server = HubServer(ignore_ranges={"org/model"})
    server.add_repo("org/model", repos["dense"])
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        line = one_error_line(layerwise("inspect-order", "org/model"))
    assert line == ("Error: org/model/model-00001-of-00004.safetensors: the server ignored the byte range request "
                    "(HTTP 200); not downloading the whole file")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_is_one_line_and_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    line = one_error_line(layerwise("inspect-order", "org/model"))
    assert time.monotonic() - start < 10
    assert line.startswith("Error: org/model: cannot connect: ")


def test_stalled_server_times_out_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server that accepts connections and never answers.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        start = time.monotonic()
        proc = layerwise("inspect-order", "org/model", env={"HF_HUB_ETAG_TIMEOUT": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "1"})
        elapsed = time.monotonic() - start
    assert one_error_line(proc) == "Error: org/model: timed out talking to the server"
    assert elapsed < 10


def test_server_stopped_mid_session(repos: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    server = HubServer()
    server.add_repo("org/model", repos["dense"])
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        assert layerwise("inspect-order", "org/model", "--json").returncode == 0
    # Same endpoint, now closed; config.json is cached, the shard headers are not.
    assert one_error_line(layerwise("inspect-order", "org/model")).startswith("Error: org/model: cannot connect: ")


def _populate_cache(repo_id: str, revision: str | None = None) -> None:
    code = "from huggingface_hub import snapshot_download\n" \
           f"print(snapshot_download({repo_id!r}, revision={revision!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_offline_reads_headers_from_the_cache(hub_env: HubServer, repos: dict[str, Path]) -> None:
    _populate_cache("org/model")
    _populate_cache("org/model", "v2")
    assert hub_env.sent_for(".safetensors") == data_sizes(repos["dense"]) + data_sizes(repos["moe"])
    hub_env.reset_counts()
    offline = {"HF_HUB_OFFLINE": "1"}
    proc = layerwise("inspect-order", "org/model", "--json", "--top", "0", env=offline, prelude=_COUNT_READS)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["source"], data["kind"]) == ("org/model", "hub")
    assert without_source(data) == without_source(local_json(repos["dense"]))
    assert hub_env.requests == []  # offline means offline
    read = int(proc.stderr.rsplit("SAFETENSORS_BYTES_READ ", 1)[1])
    assert read == header_sizes(repos["dense"]) == data["header_bytes_read"]
    v2 = layerwise("inspect-order", "org/model", "--revision", "v2", "--json", "--top", "0", env=offline)
    assert v2.returncode == 0, v2.stderr
    assert without_source(json.loads(v2.stdout)) == without_source(local_json(repos["moe"]))


def test_offline_without_the_shards_in_cache(hub_env: HubServer) -> None:
    # An online inspect-order caches config.json and the index, never the shards.
    assert layerwise("inspect-order", "org/model").returncode == 0
    line = one_error_line(layerwise("inspect-order", "org/model", env={"HF_HUB_OFFLINE": "1"}))
    assert line == ("Error: org/model: model-00001-of-00004.safetensors (and 3 more) is not in the local Hub cache, "
                    "and HF_HUB_OFFLINE=1 forbids downloading it")
    line = one_error_line(layerwise("inspect-order", "org/never-seen", env={"HF_HUB_OFFLINE": "1"}))
    assert line == "Error: org/never-seen: not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it"


def test_library_errors_map_to_one_line() -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError, SafetensorsParsingError  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)
    from huggingface_hub.utils import get_session  # noqa: PLC0415 - huggingface_hub: heavy (test collection stays fast)

    # The HTTP library huggingface_hub talks through: httpx (1.x) or httpx2 (2.x).
    http = importlib.import_module(type(get_session()).__module__.split(".")[0])

    parsing = describe_exception(SafetensorsParsingError("Failed to parse safetensors header\nfor x"), where="org/a")
    assert str(parsing) == "org/a: invalid safetensors header: Failed to parse safetensors header"
    try:
        try:
            raise http.ConnectError("[Errno 111] Connection refused")
        except http.ConnectError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file\non the Hub") from cause
    except LocalEntryNotFoundError as exc:
        assert str(describe_exception(exc, "org/a")) == "org/a: cannot connect: [Errno 111] Connection refused"
    offline = describe_exception(LocalEntryNotFoundError("Cannot find the requested files"), "org/a")
    assert "not in the local Hub cache" in str(offline)


def test_a_server_started_on_a_repo_id_is_started_at_the_commit(hub_env: HubServer, repos: dict[str, Path]) -> None:
    """`serve org/model` hands vLLM the commit its revision names now, for the weights and the tokenizer."""
    main = hub_env.resolve("org/model", "main").commit
    v2 = hub_env.resolve("org/model", "v2").commit
    for args, commit in (([], main), (["--revision", "v2"], v2), (["--revision=v2", "--max-num-seqs", "4"], v2)):
        proc = layerwise("serve", "org/model", "--dry-run", *args)
        assert proc.returncode == 0, proc.stderr
        shown = proc.stdout.split()
        assert shown[shown.index("--revision") + 1] == commit, proc.stdout
        assert shown[shown.index("--tokenizer-revision") + 1] == commit
        assert shown.count("--revision") == 1 and "v2" not in shown
    # A commit given is used as it is; a local path has no revision to pin.
    proc = layerwise("serve", "org/model", "--dry-run", "--revision", v2)
    assert proc.stdout.split().count(v2) == 1 and "--tokenizer-revision" not in proc.stdout
    proc = layerwise("serve", str(repos["dense"]), "--dry-run")
    assert "--revision" not in proc.stdout
