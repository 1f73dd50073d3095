"""The demo models: tiny Qwen3 and Qwen3-MoE checkpoints that multiply or add, trained offline and cached."""

from layerwise_cli.demo.cache import demo_checkpoint
from layerwise_cli.demo.recipe import DEMO_NAMES, demo_prompt, expected_answer

__all__ = ["DEMO_NAMES", "demo_checkpoint", "demo_prompt", "expected_answer"]
