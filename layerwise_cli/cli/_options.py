"""Options shared by several commands, defined once."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated, Literal, get_type_hints

import typer

from layerwise_cli import vllm_compat
from layerwise_cli.errors import UsageError

# The panels `--help` groups options into (`rich_help_panel`), the same names in every command.
SOURCE_PANEL = "Source"
RELOAD_PANEL = "Reload"
PLAN_PANEL = "Plan"
ENGINE_PANEL = "Engine"
SERVERS_PANEL = "Servers (--url)"
PROOF_PANEL = "Proof and safety"
OUTPUT_PANEL = "Output"

SourceArg = Annotated[
    str,
    typer.Argument(help="The weights: a folder or .safetensors file, a Hub repo id (org/name), or a URL (s3://, "
                   "gs://, az://, https://).", show_default=False),
]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", metavar="REF", help="Hub branch, tag or commit (Hub repo ids only).",
                             rich_help_panel=SOURCE_PANEL)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of tables; no progress.",
                                       rich_help_panel=OUTPUT_PANEL)]
MappingOpt = Annotated[
    Literal["auto", "table", "vllm", "generic"],
    typer.Option(
        "--mapping", metavar="HOW",
        help="How tensors map to parent layers: auto (the table, else vLLM's model class, else generic), "
        "table, vllm or generic.", rich_help_panel=PLAN_PANEL,
    ),
]

# Engine options passed through to vLLM (in-process engines and `layerwise serve`).
# vLLM's own `ModelDType` values: a typo is a usage error before anything starts.
DtypeOpt = Annotated[
    Literal["auto", "half", "float16", "bfloat16", "float", "float32"],
    typer.Option("--dtype", metavar="DTYPE", help="Engine dtype: auto, half, float16, bfloat16, float or float32.",
                 rich_help_panel=ENGINE_PANEL),
]
TensorParallelOpt = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", min=1, metavar="N", help="Tensor-parallel workers.",
                      rich_help_panel=ENGINE_PANEL)
]
PipelineParallelOpt = Annotated[
    int, typer.Option("--pipeline-parallel-size", "-pp", min=1, metavar="N",
                      help="Pipeline stages; each worker holds, and reloads, only its stage's layers.",
                      rich_help_panel=ENGINE_PANEL)
]
DataParallelOpt = Annotated[
    int, typer.Option("--data-parallel-size", "-dp", min=1, metavar="N",
                      help="Data-parallel engines behind one server (`layerwise serve`; an in-process engine "
                      "is one).", rich_help_panel=ENGINE_PANEL)
]
ExecutorBackendOpt = Annotated[
    Literal["mp", "ray", "uni", "external_launcher"] | None,
    typer.Option("--distributed-executor-backend", metavar="NAME",
                 help="vLLM's executor: mp (processes on this machine, the default) or ray (spans nodes; needs "
                 "`pip install 'layerwise\\[ray]'` and a GPU build of vLLM).", show_default=False,
                 rich_help_panel=ENGINE_PANEL),
]
MaxModelLenOpt = Annotated[int | None, typer.Option("--max-model-len", min=1, metavar="N",
                                                    help="Engine context length.", rich_help_panel=ENGINE_PANEL)]
QuantizationOpt = Annotated[
    str | None,
    typer.Option("--quantization", "-q", metavar="METHOD", help="vLLM's quantization method, e.g. fp8_per_tensor "
                 "(GPU), or layerwise_fp8 / layerwise_int8 on any CPU (docs/qerl.md).",
                 rich_help_panel=ENGINE_PANEL),
]
EnforceEagerOpt = Annotated[
    bool | None,
    typer.Option("--enforce-eager/--no-enforce-eager",
                 help="Skip graph capture. Default: eager on CPU-only machines, graphs on GPU.",
                 show_default=False, rich_help_panel=ENGINE_PANEL),
]
MemoryFractionOpt = Annotated[
    float | None,
    typer.Option("--memory-fraction", min=0.01, max=1.0, metavar="F",
                 help="vLLM's gpu_memory_utilization; on CPU the share of host memory for the KV cache (default "
                 "0.1 there).", show_default=False, rich_help_panel=ENGINE_PANEL),
]
CpusOpt = Annotated[
    str | None,
    typer.Option("--cpus", help="On a CPU host, the CPU cores the engine's workers compute on (0-3, or 0|1 for "
                 "one list per worker). Default: cores no other engine's worker on this host holds; when every "
                 "core is taken, the least loaded, shared.", show_default=False, rich_help_panel=ENGINE_PANEL),
]
OrderOpt = Annotated[
    Literal["layer", "file"],
    typer.Option("--order", metavar="ORDER", help="layer: every parent layer's tensors together; file: the order "
                 "vLLM's own loader reads, for comparison.", rich_help_panel=RELOAD_PANEL),
]
AllowNonfiniteOpt = Annotated[
    bool,
    typer.Option("--allow-nonfinite", help="Accept tensors holding NaN or Inf (refused by default, naming the "
                 "file and tensor).", rich_help_panel=PROOF_PANEL),
]
BoundedDiskOpt = Annotated[
    bool, typer.Option("--bounded-disk", help="For a Hub repo or a URL: fetch only the tensors handed over, into "
                       "files deleted afterwards; nothing is cached.", rich_help_panel=SOURCE_PANEL)
]
# The key of the servers a command reloads (`reload --url`, `watch`); `serve` takes its own, the key it requires.
ServersApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="LAYERWISE_API_KEY", show_envvar=True, show_default=False, metavar="KEY",
                 rich_help_panel=SERVERS_PANEL, help="The servers' API key, sent as a bearer token."),
]


@dataclass(frozen=True)
class EngineFlags:
    """The engine options `reload` (an engine in this process) and `serve` take, as one value.

    Each is declared once, here: its option (the alias above, flag and help) and its default.
    `takes_engine_flags` puts them in a command's signature where it names `engine: EngineFlags`.
    """

    dtype: DtypeOpt = "auto"
    tensor_parallel_size: TensorParallelOpt = 1
    pipeline_parallel_size: PipelineParallelOpt = 1
    data_parallel_size: DataParallelOpt = 1
    distributed_executor_backend: ExecutorBackendOpt = None
    max_model_len: MaxModelLenOpt = None
    quantization: QuantizationOpt = None
    enforce_eager: EnforceEagerOpt = None
    memory_fraction: MemoryFractionOpt = None
    cpus: CpusOpt = None

    def given(self, ctx: typer.Context) -> list[str]:
        """The flags the user gave on the command line (a default value typed out counts as given)."""
        # Typer vendors Click: compare the parameter source's enum by name.
        flags = {param.name: param.opts[0] for param in ctx.command.params}
        sources = {f.name: ctx.get_parameter_source(f.name) for f in fields(self)}
        return [flags[name] for name, source in sources.items() if source is not None and source.name != "DEFAULT"]

    def as_kwargs(self) -> dict[str, object]:
        """The fields by name: `server_command_line`'s and `EngineOptions`' keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# The signature's placeholder default (`takes_engine_flags` replaces the parameter).
ENGINE_DEFAULTS = EngineFlags()


def takes_engine_flags(command: Callable) -> Callable:
    """COMMAND with its `engine: EngineFlags` parameter spelled out as the nine engine options, for Typer.

    The options stand where `engine` stood, each with its alias and its default from `EngineFlags`; the
    command is called with them gathered into one `EngineFlags`.
    """
    signature = inspect.signature(command)
    hints = get_type_hints(command, include_extras=True)
    options = get_type_hints(EngineFlags, include_extras=True)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name == "engine":
            parameters += [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default,
                                             annotation=options[f.name]) for f in fields(EngineFlags)]
        else:
            parameters.append(parameter.replace(annotation=hints[parameter.name]))

    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        engine = EngineFlags(**{f.name: kwargs.pop(f.name) for f in fields(EngineFlags)})
        return command(*args, engine=engine, **kwargs)

    with_flags.__signature__ = signature.replace(parameters=parameters)
    with_flags.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": hints.get("return")}
    return with_flags


def check_quantization(method: str | None) -> None:
    """Refuse a quantization method the installed vLLM does not know, as a usage error, before any engine starts."""
    if method is None:
        return
    QUANTIZATION_METHODS = vllm_compat.quantization_methods()

    from layerwise_cli.worker.quantization import online_quant  # noqa: PLC0415, F401 - registers layerwise_fp8 / layerwise_int8

    if method not in QUANTIZATION_METHODS:
        raise UsageError(f"--quantization must be one of vLLM's methods ({', '.join(QUANTIZATION_METHODS)}), "
                         f"not {method!r}")
