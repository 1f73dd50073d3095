"""The loop's trainers: each step, new bf16 weights from torch AdamW (the demo's task, or synthetic gradients)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file

from layerwise_cli.demo import demo_checkpoint
from layerwise_cli.demo.recipe import spec_for
from layerwise_cli.demo.train import task_loss

# The demo's step: AdamW steps on the add task per written step (the answers move over a few written steps).
DEMO_INNER_STEPS = 4
DEMO_LR = 3e-3


class Trainer(Protocol):
    """What the loop asks of a trainer."""

    config: dict
    start: Path  # a checkpoint folder holding the weights before the first step (servers start on it)

    def step(self) -> None:
        """Train one step."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights now, in bf16, under their checkpoint names."""


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


class DemoTrainer:
    """Real learning: the demo's *multiply* Qwen3 trained with AdamW on the demo's *add* task.

    Every answer is one token, so the answers move from the products towards the sums over the steps, pair by
    pair (`layerwise_cli.demo.train.task_loss`, the loss the demo models were built with).
    """

    def __init__(self, lr: float = DEMO_LR, inner_steps: int = DEMO_INNER_STEPS) -> None:
        self.start = demo_checkpoint("multiply")
        self.spec = spec_for("add")
        self.config = json.loads((self.start / "config.json").read_text())
        self.params = {name: t.float().requires_grad_() for name, t in read_tensors(self.start).items()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.0)
        self.inner_steps = inner_steps
        self.losses: list[float] = []

    def step(self) -> None:
        # One thread, as the demo trains (tensors this small): beside busy-polling vLLM workers on a small
        # host, torch's spinning thread pool made a step of milliseconds take a minute.
        torch.set_num_threads(1)
        for _ in range(self.inner_steps):
            loss = task_loss(self.params, self.spec)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.losses.append(float(loss.detach()))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in self.params.items()}


class SyntheticTrainer:
    """The figures: a checkpoint of the benchmark's Qwen3 shape, trained with AdamW on fresh random gradients.

    As `benchmarks.bench_rl_steps`: an fp32 master copy, a stand-in for the noisy policy gradients of RL (Adam
    normalizes their scale away), cast to bf16 after each step. The share of bf16 values a step changes is what
    a step at that learning rate does to bf16 rounding, not what a given model's training does.
    """

    def __init__(self, start: Path, lr: float = 1e-5, seed: int = 0) -> None:
        self.start = start
        self.config = json.loads((start / "config.json").read_text())
        self.generator = torch.Generator().manual_seed(seed)
        self.params = {name: torch.nn.Parameter(t.float()) for name, t in read_tensors(start).items()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.0)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator)
        self.optimizer.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in self.params.items()}


def with_nan(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TENSORS with one NaN in the final norm (a diverged step: the loop's NaN fault)."""
    broken = dict(tensors)
    norm = broken["model.norm.weight"].clone()
    norm[0] = float("nan")
    broken["model.norm.weight"] = norm
    return broken
