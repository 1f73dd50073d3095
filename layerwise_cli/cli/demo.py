"""`layerwise demo`: the built-in default job, on two tiny debug models."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from layerwise_cli.cli._options import OUTPUT_PANEL, JsonOpt, OrderOpt
from layerwise_cli.cli._output import handle_errors, print_json, stderr, stdout
from layerwise_cli.cli._reload_view import render_report, run_with_progress
from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.report.progress import new_progress_path
from layerwise_cli.vllm_logs import quiet_engine_notes
from layerwise_cli.worker.rpc import ReloadOptions


@handle_errors
def demo_command(
    pairs: Annotated[str, typer.Option("--pairs", metavar="PAIRS", help="Digit pairs to ask, as 'a b,a b'.")]
    = "3 4,2 5,9 9",
    order: OrderOpt = "layer",
    moe: Annotated[bool, typer.Option("--moe", help="Use the tiny Qwen3-MoE debug models instead.")] = False,
    as_json: JsonOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", rich_help_panel=OUTPUT_PANEL,
                                          help="Also show vLLM's warnings and notes (as LAYERWISE_DEBUG=1 does); "
                                          "errors always show.")] = False,
) -> None:
    """Reload a running engine from *multiply* to *add* and back, and watch the answer flip.

    Builds (once, offline, cached) two tiny Qwen3 debug models trained so that
    `3 4 = ` answers 12 (multiply) or 7 (add), starts vLLM on *multiply*,
    reloads *add* in layer order with the per-layer table, then *multiply* back.

    Example: layerwise demo --pairs "3 4,7 8"

    The output explained: docs/quickstart.md.
    """
    from layerwise_cli.client.engine.generate import greedy_answers  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
    from layerwise_cli.client.engine.in_process import EngineOptions, start_engine, stop_engine  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
    from layerwise_cli.client.engine.session import reload_as  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
    from layerwise_cli.demo import demo_checkpoint, demo_prompt, expected_answer  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    try:
        asked = [tuple(int(x) for x in pair.split()) for pair in pairs.split(",")]
        if not asked or any(len(p) != 2 or not all(0 <= x <= 9 for x in p) for p in asked):
            raise ValueError
    except ValueError:
        raise UsageError(f"--pairs must be single-digit pairs like '3 4,2 5', not {pairs!r}") from None
    first, second = ("moe-multiply", "moe-add") if moe else ("multiply", "add")
    engine = EngineOptions(max_model_len=64)
    if not verbose:
        engine = quiet_engine_notes(engine)
    if not as_json:
        stderr.print("Building the debug models (once; cached) ...")
    paths = {name: str(demo_checkpoint(name)) for name in (first, second)}
    prompts = [demo_prompt(a, b) for a, b in asked]
    if not as_json:
        stderr.print(f"Starting vLLM on {first} ...")
    llm = start_engine(paths[first], engine)
    try:
        answers = {f"{first} (start)": greedy_answers(llm, prompts)}
        reports = []
        for name in (second, first):
            report = run_with_progress(
                lambda path, name=name: reload_as(llm, paths[name], name,
                                                  ReloadOptions(order=order, progress_path=path)),
                None if as_json else new_progress_path(), f"reload {name}", show=not as_json)
            reports.append(report)
            answers[f"after reloading {name}"] = greedy_answers(llm, prompts)
    finally:
        stop_engine(llm)
    # Rendered once the engine is stopped, so that no engine log line lands inside the report.
    if not as_json:
        render_report(reports[0], title=f"Reload {second}")
    expected = {first: [expected_answer(first, a, b) for a, b in asked],
                second: [expected_answer(second, a, b) for a, b in asked]}
    flipped = (answers[f"after reloading {second}"] == expected[second]
               and answers[f"after reloading {first}"] == expected[first]
               and answers[f"{first} (start)"] == expected[first])
    if as_json:
        print_json({"prompts": prompts, "answers": answers, "expected": expected, "flipped": flipped,
                    "reloads": [r.to_dict() for r in reports]})
    else:
        table = Table(title="Answers", title_justify="left")
        table.add_column("prompt")
        for column in answers:
            table.add_column(column, justify="right")
        for i, prompt in enumerate(prompts):
            table.add_row(repr(prompt), *(answers[column][i] for column in answers))
        stdout.print(table)
        second_report = reports[1]
        stdout.print(f"Reloaded {second} then {first} in place: {reports[0].wall_s:.3f} s and "
                     f"{second_report.wall_s:.3f} s; answers {'flipped as expected' if flipped else 'DID NOT flip'}.")
    if not flipped:
        raise LayerwiseError("the engine's answers did not follow the reloaded weights")
