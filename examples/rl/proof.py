"""Proof at sampled steps: each server, while it holds the step, is verified against the step by every tensor
(`--verify`, over HTTP) and its fingerprints and answers taken; after the run, an engine started fresh on the full
step must hold the same fingerprints and give the same answers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx

from examples.rl.faults import Check
from layerwise_cli import save_checkpoint
from layerwise_cli.client.engine.in_process import EngineOptions, ask_workers, start_engine, stop_engine
from layerwise_cli.client.servers.api import ServerClient
from layerwise_cli.client.servers.reload_servers import server_fingerprints
from layerwise_cli.worker.rpc import FingerprintsAnswer, FingerprintsCall

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class Sample:
    """What each server held at one step."""

    step: int
    name: str
    folder: Path  # the full step, with the model's tokenizer: what the fresh engine starts on
    verified: dict[str, str]  # server -> `ok`, or why its --verify failed
    fingerprints: dict[str, dict[str, str]]  # server -> module -> fingerprint
    answers: dict[str, list[str]]  # server -> greedy answer per prompt


def write_full_step(folder: Path, tensors, config: dict, start: Path) -> Path:
    """The step written in full (what the fresh engine starts on), with the tokenizer of START."""
    save_checkpoint(tensors.items(), folder, config=config, marker=None)
    for name in TOKENIZER_FILES:
        if (start / name).is_file():
            shutil.copy2(start / name, folder / name)
    return folder


def greedy(url: str, model: str, prompts: list[str]) -> list[str]:
    out = []
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            out.append(response.json()["choices"][0]["text"])
    return out


def sample(step: int, name: str, source: tuple[str, str | None], folder: Path, urls: list[str], model: str,
           prompts: list[str]) -> Sample:
    """Verify each server against SOURCE (the step as the servers read it: a path or URL, and a Hub commit or
    None), and take its fingerprints and answers."""
    verified: dict[str, str] = {}
    for url in urls:
        client = ServerClient(url, timeout=600)
        try:
            result = client.verify(*source)
            verified[url] = "ok" if result.ok else f"differ: {list(result.mismatched[:3])}, errors: {result.errors}"
        except Exception as exc:  # noqa: BLE001 - recorded as the check's outcome
            verified[url] = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
    return Sample(step, name, folder, verified, {url: server_fingerprints(url) for url in urls},
                  {url: greedy(url, model, prompts) for url in urls})


def prove(samples: list[Sample], prompts: list[str]) -> list[Check]:
    """For each sample, an engine started fresh on its full step against what each server held then."""
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: heavy (`--help` stays fast)

    checks = []
    for s in samples:
        llm = start_engine(str(s.folder), EngineOptions(max_model_len=64))
        try:
            fresh = FingerprintsAnswer.from_json(ask_workers(llm, FingerprintsCall())[0]).fingerprints
            outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            answers = [o.outputs[0].text for o in outputs]
        finally:
            stop_engine(llm)
        for url in s.verified:
            differ = sorted(k for k in fresh.keys() | s.fingerprints[url].keys()
                            if fresh.get(k) != s.fingerprints[url].get(k))
            wrong = sum(a != b for a, b in zip(answers, s.answers[url], strict=True))
            ok = s.verified[url] == "ok" and not differ and not wrong
            checks.append(Check(f"{s.name} on {url} equals a fresh engine", ok,
                                f"--verify {s.verified[url]}; {len(fresh) - len(differ)}/{len(fresh)} fingerprints "
                                f"equal; {len(prompts) - wrong}/{len(prompts)} answers equal"))
    return checks
