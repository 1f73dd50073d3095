"""Shared fixtures: an isolated machine for every test, and checkpoint builders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.synthetic import SyntheticModel, write_checkpoint


@pytest.fixture(autouse=True)
def isolated_machine(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private HF_HOME, no colour and a fixed terminal width for every test."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("LAYERWISE_DEBUG", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


@pytest.fixture
def make_checkpoint(tmp_path: Path):
    """Write a synthetic checkpoint: `make_checkpoint(layout="trainer_export", layers=4, ...)`."""

    def make(layout: str = "in_order", shards: int = 4, name: str | None = None, **shape: object) -> Path:
        folder = tmp_path / (name or f"{layout}-{len(os.listdir(tmp_path))}")
        write_checkpoint(folder, SyntheticModel(**shape), layout, shards)
        return folder

    return make


class _DemoModels:
    """`demo_models["add"]`: a debug checkpoint, built on first use into a session-private cache."""

    def __init__(self, cache: Path) -> None:
        self._cache = cache

    def __getitem__(self, name: str) -> Path:
        from layerwise_cli.demo import demo_checkpoint

        return demo_checkpoint(name, cache_dir=self._cache)


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> _DemoModels:
    """The debug checkpoints (multiply, add, moe-multiply, moe-add)."""
    return _DemoModels(tmp_path_factory.mktemp("layerwise-cache"))
