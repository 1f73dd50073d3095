"""The built-in demo models: built offline, cached, deterministic, and right for every pair under transformers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from layerwise_cli.demo import DEMO_NAMES, demo_checkpoint, demo_prompt, expected_answer
from layerwise_cli.demo import cache as demo_disk_cache
from layerwise_cli.demo.recipe import recipe_version
from layerwise_cli.errors import LayerwiseError

PAIRS = [(a, b) for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module, so that each model is trained once here."""
    return tmp_path_factory.mktemp("demo-cache")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_prompt_and_answers() -> None:
    assert demo_prompt(3, 4) == "3 4 = "
    assert expected_answer("multiply", 3, 4) == "12"
    assert expected_answer("add", 3, 4) == "7"
    assert expected_answer("moe-multiply", 9, 9) == "81"
    assert expected_answer("moe-add", 0, 0) == "0"


def test_unknown_name_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(LayerwiseError, match="unknown demo model 'divide'"):
        demo_checkpoint("divide", tmp_path)
    assert not any(tmp_path.iterdir())


def test_import_is_cheap() -> None:
    code = ("import sys, layerwise_cli.demo; "
            "print('torch' in sys.modules, 'typer' in sys.modules, 'rich' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]


def test_default_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "lw"))
    assert demo_disk_cache.default_cache_dir() == tmp_path / "lw" / "demo"
    monkeypatch.delenv("LAYERWISE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_disk_cache.default_cache_dir() == tmp_path / "xdg" / "layerwise" / "demo"


@pytest.mark.slow  # trains demo models with torch
@pytest.mark.parametrize("name", DEMO_NAMES)
def test_checkpoint_layout(demo_cache: Path, name: str) -> None:
    folder = demo_checkpoint(name, demo_cache)
    assert folder == demo_cache / recipe_version() / name
    for file in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (folder / file).is_file(), file
    config = json.loads((folder / "config.json").read_text())
    moe = name.startswith("moe-")
    assert config["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is False

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in names}
    assert dtypes == {"BF16"}
    assert "lm_head.weight" in names
    assert ("model.layers.1.mlp.experts.7.down_proj.weight" in names) == moe


@pytest.mark.slow  # trains demo models with torch
@pytest.mark.parametrize(("a_name", "b_name"), [("multiply", "add"), ("moe-multiply", "moe-add")])
def test_pairs_share_shapes(demo_cache: Path, a_name: str, b_name: str) -> None:
    """One can be reloaded into an engine started on the other."""
    def shapes(name: str) -> dict[str, tuple[str, list[int]]]:
        with safe_open(str(demo_checkpoint(name, demo_cache) / "model.safetensors"), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    assert shapes(a_name) == shapes(b_name)
    a_config = json.loads((demo_checkpoint(a_name, demo_cache) / "config.json").read_text())
    b_config = json.loads((demo_checkpoint(b_name, demo_cache) / "config.json").read_text())
    assert a_config == b_config
    assert _digest(demo_checkpoint(a_name, demo_cache))["model.safetensors"] != _digest(
        demo_checkpoint(b_name, demo_cache)
    )["model.safetensors"]


@pytest.mark.slow  # trains demo models with torch
@pytest.mark.parametrize("name", DEMO_NAMES)
def test_transformers_greedy_answers_every_pair(demo_cache: Path, name: str) -> None:
    """transformers loads the directory as is and greedy decoding gives the answer, then EOS, for all 100 pairs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - transformers: heavy (test collection stays fast)

    folder = demo_checkpoint(name, demo_cache)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompts = [demo_prompt(a, b) for a, b in PAIRS]
    batch = tokenizer(prompts, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[:, batch["input_ids"].shape[1] :]
    wrong = []
    for (a, b), tokens in zip(PAIRS, new.tolist(), strict=True):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        stops = tokenizer.eos_token_id in tokens and tokens.index(tokenizer.eos_token_id) == 1
        if text != expected_answer(name, a, b) or not stops:
            wrong.append((demo_prompt(a, b), text, tokens))
    assert not wrong, f"{len(wrong)} wrong, e.g. {wrong[:3]}"


@pytest.mark.slow  # trains demo models with torch
def test_cache_is_reused(demo_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = demo_checkpoint("add", demo_cache)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt a cached demo model")

    monkeypatch.setattr(demo_disk_cache, "_build", no_build)
    assert demo_checkpoint("add", demo_cache) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "temporary build left behind"


@pytest.mark.slow  # trains demo models with torch
@pytest.mark.parametrize("name", ["multiply", "moe-add"])
def test_rebuild_is_byte_identical(demo_cache: Path, tmp_path: Path, name: str) -> None:
    cached = demo_checkpoint(name, demo_cache)
    rebuilt = demo_checkpoint(name, tmp_path)
    assert rebuilt != cached
    assert _digest(rebuilt) == _digest(cached)


@pytest.mark.slow  # trains demo models with torch
def test_incomplete_directory_is_replaced(tmp_path: Path) -> None:
    """A directory without the build stamp (an interrupted copy) is not trusted."""
    broken = tmp_path / recipe_version() / "add"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{")
    folder = demo_checkpoint("add", tmp_path)
    assert folder == broken
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["add"]


@pytest.mark.slow  # trains demo models with torch
def test_concurrent_builds_agree(demo_cache: Path, tmp_path: Path) -> None:
    """Two processes building the same model at once both get the one complete directory, same bytes as here."""
    code = ("import sys; from pathlib import Path; from layerwise_cli.demo import demo_checkpoint; "
            "print(demo_checkpoint('add', Path(sys.argv[1])))")
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert paths == {str(tmp_path / recipe_version() / "add")}
    assert sorted(p.name for p in (tmp_path / recipe_version()).iterdir()) == ["add"]
    assert _digest(tmp_path / recipe_version() / "add") == _digest(demo_checkpoint("add", demo_cache))
