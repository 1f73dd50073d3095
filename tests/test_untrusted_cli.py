"""Untrusted checkpoints and operator mistakes: what is refused, and that every refusal is one clear line."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

import layerwise_cli.reorder.side_files as side_files
from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.sources import INDEX_NAME, open_checkpoint, shard_file
from layerwise_cli.cli.app import app
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.server.command_line import governed_option
from tests.support.hub_server import HubServer
from tests.support.synthetic import SyntheticModel, write_checkpoint, write_safetensors

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
MODEL = SyntheticModel(layers=2)


def _cli(*args: str):
    return runner.invoke(app, list(args))


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert stderr.startswith("Error: "), repr(stderr)  # no blank line or bar before it
    return lines[0]


def _checkpoint(folder: Path, shards: int = 2) -> Path:
    write_checkpoint(folder, MODEL, "in_order", shards)
    return folder


def _point_index_at(folder: Path, entry_for) -> str:
    """Rewrite the index so that the first shard's tensors are said to live at `entry_for(moved_shard)`."""
    index_path = folder / INDEX_NAME
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    outside = folder.parent / "outside"
    outside.mkdir(exist_ok=True)
    moved = outside / first
    (folder / first).rename(moved)
    entry = entry_for(folder, moved)
    index["weight_map"] = {k: (entry if v == first else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return entry


def _symlink_first_shard_outside(folder: Path, moved_to: Path | None = None) -> str:
    shard = sorted(folder.glob("*.safetensors"))[0]
    outside = folder.parent / "outside"
    outside.mkdir(exist_ok=True)
    shard.rename(outside / shard.name)
    shard.symlink_to(outside / shard.name)
    return shard.name


# --- 1. `serve`: pass-through options layerwise governs ---------------------------------------------------------


@pytest.mark.parametrize("extra", [
    ["--", "--host", "0.0.0.0"],
    ["--", "--host=0.0.0.0"],
    ["--hos", "0.0.0.0"],  # Click passes an unknown option through; vLLM's argparse reads a unique prefix
    ["--", "--ho=::"],
    ["--", "--port", "80"],
    ["--", "--uds", "/tmp/x.sock"],
    ["--", "--api-key", "other"],
    ["--", "--api_key=other"],  # vLLM accepts `_` for `-`
    ["--", "--worker-extension-cls", "evil.Ext"],
    ["--", "--worker_extension_cls=evil.Ext"],
    ["--", "--model", "other/model"],
    ["--", "--config", "serve.yaml"],  # a config file can set any of them
    ["--", "--dtype", "float16"],
    ["--", "-tp", "2"],
    ["--", "-tp2"],
    ["--", "--quantization=fp8"],
])
def test_serve_refuses_governed_pass_through_options(extra):
    result = _cli("serve", "some/model", "--dry-run", *extra)
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.stderr)
    assert "is set by layerwise serve and cannot pass through to vLLM" in line
    assert result.stdout == ""  # no command line: nothing would have started


@pytest.mark.usefixtures("local_some_model")
@pytest.mark.parametrize("extra", [["--", "--max-num-seqs", "4"], ["--", "--model-impl", "vllm"],
                                   ["--max-num-seqs", "4"], ["--", "--hf-overrides", "{}"]])
def test_serve_passes_other_options_through(extra):
    result = _cli("serve", "some/model", "--dry-run", *extra)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(shlex.join(extra[-2:]))
    assert " --host 127.0.0.1 " in result.stdout


def test_governed_option_unit():
    assert governed_option("--host") == "--host"
    assert governed_option("--h") is None  # too short to name one option; argparse finds it ambiguous
    assert governed_option("--max-num-seqs") is None
    assert governed_option("-q") == "--quantization"
    assert governed_option("--port=1") == "--port"


# --- 2. index path traversal: one containment rule, every command ----------------------------------------------


TRAVERSALS = {
    "dot-dot": lambda folder: _point_index_at(folder, lambda f, moved: f"../outside/{moved.name}"),
    "absolute": lambda folder: _point_index_at(folder, lambda f, moved: str(moved)),
    "symlink": lambda folder: _symlink_first_shard_outside(folder),
}


@pytest.mark.parametrize("case", list(TRAVERSALS))
def test_inspect_order_and_reorder_refuse_a_shard_outside_the_checkpoint(tmp_path, case):
    src = _checkpoint(tmp_path / "src")
    entry = TRAVERSALS[case](src)
    inspected = _cli("inspect-order", str(src))
    assert inspected.exit_code == 1
    line = _one_error_line(inspected.stderr)
    assert "outside the checkpoint directory" in line and repr(Path(entry).name)[1:-1] in line
    assert line.startswith(f"Error: {src / INDEX_NAME}: ")  # names the index and the entry
    dst = tmp_path / "dst"
    reordered = _cli("reorder", str(src), str(dst))
    assert reordered.exit_code == 1
    assert "outside the checkpoint directory" in _one_error_line(reordered.stderr)
    assert not dst.exists()


def test_a_symlinked_shard_outside_is_refused_without_an_index_too(tmp_path):
    src = _checkpoint(tmp_path / "src")
    (src / INDEX_NAME).unlink()
    name = _symlink_first_shard_outside(src)
    with pytest.raises(LayerwiseError) as info:
        open_checkpoint(str(src))
    assert "outside the checkpoint directory" in str(info.value) and name in str(info.value)


def test_links_that_stay_inside_are_fine(tmp_path):
    src = _checkpoint(tmp_path / "src")
    real = src / "real"
    real.mkdir()
    shard = sorted(src.glob("*.safetensors"))[0]
    shard.rename(real / shard.name)
    shard.symlink_to(Path("real") / shard.name)
    assert len(open_checkpoint(str(src)).shards) == 2


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / ("a" * 40)
    _checkpoint(tmp_path / "plain")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted((tmp_path / "plain").iterdir())):
        path.rename(repo / "blobs" / f"blob{i}")
        (snapshot / path.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert len(open_checkpoint(str(snapshot)).shards) == 2
    # ... but not outside the repo's own cache folder.
    outside = tmp_path / "elsewhere.safetensors"
    write_safetensors(outside, [("x", "F32", (2,))])
    with pytest.raises(LayerwiseError, match="outside the checkpoint directory"):
        shard_file(snapshot, "../../../elsewhere.safetensors", "index")
    (snapshot / "evil.safetensors").symlink_to(outside)
    with pytest.raises(LayerwiseError, match="outside the checkpoint directory"):
        shard_file(snapshot, "evil.safetensors", "index")


@pytest.mark.parametrize("name", ["", "/etc/passwd", "a/../../b.safetensors", ".."])
def test_shard_file_refuses_names_that_leave_the_folder(tmp_path, name):
    with pytest.raises(LayerwiseError, match="outside the checkpoint directory"):
        shard_file(tmp_path, name, "the index")
    with pytest.raises(LayerwiseError, match="outside the checkpoint directory"):
        shard_file(None, name, "the index")  # a Hub shard read by URL: the name alone decides


def test_the_reader_in_the_engine_uses_the_same_rule(tmp_path):
    from layerwise_cli.worker.stream.shard_reader import ShardReader  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    write_safetensors(tmp_path / "outside.safetensors", [("x", "F32", (2,))])
    folder = tmp_path / "ckpt"
    folder.mkdir()
    entry = TensorEntry(name="x", dtype="F32", shape=(2,), begin=0, end=8, shard="../outside.safetensors")
    with pytest.raises(LayerwiseError, match="outside the checkpoint directory"):
        ShardReader(folder).read(PlannedTensor(entry, None))


def _hub_layerwise(endpoint: str, *args: str, offline: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "PYTHONPATH": str(REPO)}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = f"import sys\nfrom layerwise_cli.cli.app import main\nsys.argv = ['layerwise', *{list(args)!r}]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_hub_repos_with_a_traversing_index_are_refused_online_and_from_the_cache(tmp_path):
    evil = _checkpoint(tmp_path / "evil")
    _point_index_at(evil, lambda f, moved: f"../../../{moved.name}")
    shutil.rmtree(tmp_path / "outside")
    with HubServer() as hub:
        hub.add_repo("org/evil", evil)
        online = _hub_layerwise(hub.endpoint, "inspect-order", "org/evil")
        assert online.returncode == 1, online.stderr
        line = _one_error_line(online.stderr)
        assert line.startswith(f"Error: org/evil/{INDEX_NAME}: ") and "outside the checkpoint directory" in line
        # The snapshot in the local cache (what reload and reorder read) gets the same refusal.
        fetch = "from huggingface_hub import snapshot_download\nsnapshot_download('org/evil')"
        subprocess.run([sys.executable, "-c", fetch], check=True, timeout=120,
                       env={**os.environ, "HF_ENDPOINT": hub.endpoint})
        offline = _hub_layerwise(hub.endpoint, "inspect-order", "org/evil", offline=True)
        assert offline.returncode == 1, offline.stderr
        line = _one_error_line(offline.stderr)
        assert INDEX_NAME in line and "outside the checkpoint directory" in line


# --- 3. side files in `reorder` ------------------------------------------------------------------------------


def test_reorder_copies_only_regular_side_files_inside_the_source(tmp_path):
    src = _checkpoint(tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's")
    (src / "vocab.txt").symlink_to("/dev/zero")  # would never end
    (src / "notes.txt").symlink_to(secret)  # would copy another file's contents
    os.mkfifo(src / "pipe.txt")  # would wait forever for a writer
    (src / "card.md").write_text("model card")
    (src / "alias.md").symlink_to("card.md")  # inside: copied as the file it names
    dst = tmp_path / "dst"
    started = time.monotonic()
    result = _cli("reorder", str(src), str(dst), "--json")
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 60
    data = json.loads(result.stdout)
    assert sorted(data["files_copied"]) == ["alias.md", "card.md", "config.json"]
    skipped = " ".join(data["files_skipped"])
    assert "vocab.txt (a symlink to outside the source)" in skipped
    assert "notes.txt (a symlink to outside the source)" in skipped
    assert "pipe.txt (not a regular file)" in skipped
    assert not (dst / "vocab.txt").exists() and not (dst / "notes.txt").exists() and not (dst / "pipe.txt").exists()
    assert (dst / "alias.md").read_text() == "model card" and not (dst / "alias.md").is_symlink()


def test_a_hostname_link_is_not_copied(tmp_path):
    if not Path("/etc/hostname").is_file():
        pytest.skip("no /etc/hostname on this machine")
    src = _checkpoint(tmp_path / "src")
    (src / "notes.txt").symlink_to("/etc/hostname")
    result = _cli("reorder", str(src), str(tmp_path / "dst"), "--json")
    assert result.exit_code == 0, result.output
    assert "notes.txt" not in json.loads(result.stdout)["files_copied"]


def test_side_files_are_copied_up_to_the_size_they_had(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "grows.txt").write_bytes(b"a" * 100)
    real_read = os.read

    def growing_read(fd, n):  # the file grows while it is copied: the copy stops at 100 bytes
        with open(src / "grows.txt", "ab") as f:
            f.write(b"b" * 1000)
        return real_read(fd, n)

    monkeypatch.setattr(side_files.os, "read", growing_read)
    assert side_files.copy_side_file(src, Path("grows.txt"), tmp_path / "out.txt") is None
    assert (tmp_path / "out.txt").read_bytes() == b"a" * 100


# --- 4. `reorder --force` replaces only a checkpoint ------------------------------------------------------------


def test_force_refuses_a_directory_of_unrelated_files(tmp_path):
    src = _checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    (dst / "photos").mkdir(parents=True)
    (dst / "notes.txt").write_text("mine")
    (dst / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    result = _cli("reorder", str(src), str(dst), "--force")
    assert result.exit_code == 1
    line = _one_error_line(result.stderr)
    assert "--force replaces only a checkpoint directory" in line and "cat.jpg" in line
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["notes.txt", "photos", "photos/cat.jpg"]


def test_force_refuses_a_regular_file_and_a_symlink(tmp_path):
    src = _checkpoint(tmp_path / "src")
    plain = tmp_path / "plain"
    plain.write_text("a file")
    result = _cli("reorder", str(src), str(plain), "--force")
    assert result.exit_code == 1
    assert "is a file, not a directory" in _one_error_line(result.stderr)
    assert plain.read_text() == "a file"
    other = _checkpoint(tmp_path / "other")
    link = tmp_path / "link"
    link.symlink_to(other)
    result = _cli("reorder", str(src), str(link), "--force")
    assert result.exit_code == 1 and "is a symlink" in _one_error_line(result.stderr)
    assert link.is_symlink()


def test_force_replaces_a_checkpoint_written_before(tmp_path):
    src = _checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    assert _cli("reorder", str(src), str(dst)).exit_code == 0
    again = _cli("reorder", str(src), str(dst), "--force", "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["replaced"] is True


# --- 7. one-line errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, part", [
    (["inspect-order", "--bogus", "x"], "No such option: --bogus"),
    (["serve"], "Missing argument"),
    (["reorder", "a", "b", "--max-shard-size", "lots"], "--max-shard-size"),
    (["serve", "m", "--port", "99999"], "--port"),
    (["inspect-order", "x", "--top", "-1"], "--top"),
])
def test_option_parser_errors_are_one_line_exit_2(args, part):
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    line = _one_error_line(result.stderr)
    assert part in line and "--help" in line
    assert "╭" not in result.output and "Usage:" not in result.output


def test_file_name_too_long_names_the_path(tmp_path):
    long = tmp_path / ("x" * 300)
    result = _cli("inspect-order", str(long))
    assert result.exit_code == 1
    line = _one_error_line(result.stderr)
    assert line == f"Error: {long}: File name too long"


def test_permission_denied_names_the_path(tmp_path, monkeypatch):
    # The message path, whoever runs the tests (root reads every file): listing the folder fails.
    src = _checkpoint(tmp_path / "src")

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("layerwise_cli.checkpoint.sources.os.listdir", denied)
    result = _cli("inspect-order", str(src))
    assert result.exit_code == 1
    assert _one_error_line(result.stderr) == f"Error: {src}: permission denied"


def _as_nobody() -> list[str] | None:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"] if setpriv else None


def test_a_folder_that_cannot_be_listed_says_permission_denied(tmp_path):
    """The real condition: a folder without read permission, read by a user who is not root."""
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot drop to a user that file modes apply to")
    base = Path(tempfile.mkdtemp(prefix="layerwise-perm-"))
    try:
        base.chmod(0o755)
        locked = _checkpoint(base / "locked")
        locked.chmod(0o311)  # enter, but not list
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(base / "hf")}
        proc = subprocess.run([*prefix, sys.executable, "-m", "layerwise_cli", "inspect-order", str(locked)],
                              capture_output=True, text=True, timeout=120, env=env, cwd=base)
        assert proc.returncode == 1, proc.stderr
        assert _one_error_line(proc.stderr) == f"Error: {locked}: permission denied"
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


_SLOW_IMPORT = textwrap.dedent("""
    import importlib.abc, sys, time
    marker = sys.argv[1]
    class SlowRich(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "rich.table":  # imported while the CLI's commands load
                open(marker, "w").close()
                time.sleep(60)
            return None
    sys.meta_path.insert(0, SlowRich())
    from layerwise_cli.cli.app import main
    sys.argv = ["layerwise", "inspect-order", "x"]
    main()
""")


def test_ctrl_c_while_the_cli_starts_is_one_line_exit_130(tmp_path):
    marker = tmp_path / "importing"
    # As at a terminal: a job started in the background of a non-interactive
    # shell (a CI script's `cmd &`) inherits SIGINT ignored, and Python then
    # never raises KeyboardInterrupt; the child gets the default disposition.
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORT, str(marker)], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err == "Error: interrupted\n" and out == ""


def test_reorder_errors_start_with_the_error_when_stderr_is_a_pipe(tmp_path):
    src = _checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    proc = subprocess.run([sys.executable, "-m", "layerwise_cli", "reorder", str(src), str(dst)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    assert proc.stderr == f"Error: {dst}: already exists; pass --force to replace it\n"
    # A failure after the bar started: still nothing but the error.
    corrupt = textwrap.dedent("""
        import sys
        import layerwise_cli.reorder.write as write
        real, state = write.write_chunk, {"done": False}
        def flip_one_byte(fd, data, offset):
            if offset > 0 and not state["done"]:
                state["done"] = True
                data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
            real(fd, data, offset)
        write.write_chunk = flip_one_byte
        from layerwise_cli.cli.app import main
        sys.argv = ["layerwise", "reorder", *sys.argv[1:]]
        main()
    """)
    other = tmp_path / "other"
    proc = subprocess.run([sys.executable, "-c", corrupt, str(src), str(other), "--verify"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: {other}: --verify: 1 tensor(s) differ") and proc.stderr.count("\n") == 1


# --- 8. misleading messages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_broken_symlink_shaped_like_a_repo_id_is_not_a_hub_id(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a request would say "cannot connect"
    (tmp_path / "org").mkdir()
    link = Path("org/name")
    link.symlink_to("missing-target" if kind == "dangling" else "name")
    for args in (["inspect-order", "org/name"], ["reload", "--weights-path", "org/name"]):
        result = _cli(*args)
        assert result.exit_code == 1
        line = _one_error_line(result.stderr)
        assert line.startswith("Error: org/name: ")
        assert ("dangling link" if kind == "dangling" else "symlink loop") in line
        assert "connect" not in line


def test_a_pytorch_bin_file_gets_a_conversion_hint(tmp_path):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, path)
    renamed = tmp_path / "weights.data"
    shutil.copy(path, renamed)  # the zip magic tells, whatever the name
    for target in (path, renamed):
        result = _cli("inspect-order", str(target))
        assert result.exit_code == 1
        line = _one_error_line(result.stderr)
        assert "PyTorch pickle checkpoint" in line and "safe_serialization=True" in line
    folder = tmp_path / "bin-only"
    folder.mkdir()
    shutil.copy(path, folder / "pytorch_model.bin")
    line = _one_error_line(_cli("inspect-order", str(folder)).stderr)
    assert "only PyTorch .bin files" in line and "safe_serialization=True" in line


class _HtmlHandler(BaseHTTPRequestHandler):
    def _page(self) -> None:
        body = ("<!DOCTYPE html><html><head><title>Welcome to nginx!</title></head><body>"
                + "<p>lorem ipsum</p>\n" * 500 + "</body></html>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _page

    def log_message(self, *args: object) -> None:
        pass


def test_a_non_vllm_server_is_named_not_quoted(tmp_path):
    src = _checkpoint(tmp_path / "src")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HtmlHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = _cli("reload", "--weights-path", str(src), "--url", url, "--timeout", "10")
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    assert "<" not in result.stderr and "lorem" not in result.stderr and len(line) < 400
    assert "an HTML page titled 'Welcome to nginx!'" in line


# --- 9. one rule for a tensor in two shards -------------------------------------------------------------------


def test_a_tensor_in_two_shards_is_refused_by_inspect_order_as_by_reorder(tmp_path):
    src = _checkpoint(tmp_path / "src")
    (src / INDEX_NAME).unlink()
    first = sorted(src.glob("*.safetensors"))[0]
    shutil.copy(first, src / "zz-copy.safetensors")
    for args in (["inspect-order", str(src)], ["reorder", str(src), str(tmp_path / "dst")]):
        result = _cli(*args)
        assert result.exit_code == 1
        line = _one_error_line(result.stderr)
        assert "is in both" in line and "zz-copy.safetensors" in line and "vLLM would load it twice" in line


# --- 10. the Python examples of the README and the docs site ------------------------------------------------


def test_the_python_examples_have_the_main_guard():
    """vLLM starts engine processes by spawning, which re-imports the main module: an example that builds an
    engine at import fails with vLLM's bootstrapping error, so every engine start sits under the guard, on every
    page (the README's and the Python API page's examples among them)."""
    def engine_blocks(path: Path) -> list[str]:
        blocks = [b.split("```")[0] for b in path.read_text().split("```python")[1:]]
        return [b for b in blocks if "LLM(" in b or "start_engine(" in b]

    for page in ("README.md", "docs/python-api.md"):
        assert engine_blocks(REPO / page), f"{page} has no Python example that starts an engine"
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for code in (code for page in pages for code in engine_blocks(page)):
        tree = ast.parse(code)
        guards = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        assert guards, code
        for node in tree.body:
            if node in guards or isinstance(node, (ast.FunctionDef, ast.Import, ast.ImportFrom)):
                continue
            calls = [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
            assert not any(c.endswith(("LLM", "start_engine", "reload")) for c in calls), ast.unparse(node)
