"""Greedy answers from an engine, for demos and checks."""

from __future__ import annotations


def greedy_answers(llm, prompts: list[str], max_tokens: int = 4) -> list[str]:
    """Greedy completions of `prompts`, stripped of surrounding spaces."""
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy, only where an engine is driven

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0].text.strip() for output in outputs]
