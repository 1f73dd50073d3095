"""Options shared by several commands, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

SourceArg = Annotated[
    str,
    typer.Argument(help="A .safetensors file, a directory of shards, or a Hub repo id (org/name).", show_default=False),
]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Hub branch, tag or commit (Hub repo ids only).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of tables; no progress.")]
MappingOpt = Annotated[
    str,
    typer.Option(
        "--mapping",
        help="How tensors map to parent layers: auto (table, else vLLM's model class, else generic), "
        "table, vllm or generic.",
    ),
]
