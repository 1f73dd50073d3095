"""Options shared by several commands, defined once."""

from __future__ import annotations

from typing import Annotated, Literal

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
    Literal["auto", "table", "vllm", "generic"],
    typer.Option(
        "--mapping",
        help="How tensors map to parent layers: auto (table, else vLLM's model class, else generic), "
        "table, vllm or generic.",
    ),
]

# Engine options passed through to vLLM (in-process engines and `layerwise serve`).
# vLLM's own `ModelDType` values: a typo is a usage error before anything starts.
DtypeOpt = Annotated[
    Literal["auto", "half", "float16", "bfloat16", "float", "float32"],
    typer.Option("--dtype", help="Engine dtype."),
]
TensorParallelOpt = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="Tensor-parallel workers.")
]
PipelineParallelOpt = Annotated[
    int, typer.Option("--pipeline-parallel-size", "-pp", min=1,
                      help="Pipeline stages: each worker holds, and reloads, only its stage's layers.")
]
DataParallelOpt = Annotated[
    int, typer.Option("--data-parallel-size", "-dp", min=1,
                      help="Data-parallel engines behind one server (layerwise serve; an in-process engine "
                      "is one engine).")
]
ExecutorBackendOpt = Annotated[
    Literal["mp", "ray", "uni", "external_launcher"] | None,
    typer.Option("--distributed-executor-backend",
                 help="vLLM's executor: mp (processes on this machine; vLLM's default) or ray (spans nodes; "
                 "needs `pip install 'layerwise[ray]'` and a GPU build of vLLM).", show_default=False),
]
MaxModelLenOpt = Annotated[int | None, typer.Option("--max-model-len", min=1, help="Engine context length.")]
QuantizationOpt = Annotated[
    str | None,
    typer.Option("--quantization", "-q", help="vLLM quantization method, e.g. an online one such as "
                 "fp8_per_tensor (GPU), or layerwise_fp8 / layerwise_int8 (any CPU; emulated, see docs/qerl.md)."),
]
EnforceEagerOpt = Annotated[
    bool | None,
    typer.Option("--enforce-eager/--no-enforce-eager",
                 help="Skip graph capture. Default: eager on CPU-only machines, graphs on GPU.",
                 show_default=False),
]
MemoryFractionOpt = Annotated[
    float | None,
    typer.Option("--memory-fraction", min=0.01, max=1.0,
                 help="vLLM gpu_memory_utilization (on CPU: the share of host memory for the KV cache; "
                 "default 0.1 there).", show_default=False),
]
CpusOpt = Annotated[
    str | None,
    typer.Option("--cpus", help="On a CPU host, the CPU cores the engine's workers compute on (0-3, or 0|1 for "
                 "one list per worker). Default: cores no other engine's worker on this host holds; when every "
                 "core is taken, the least loaded, shared.", show_default=False),
]
OrderOpt = Annotated[
    Literal["layer", "file"],
    typer.Option("--order", help="layer: stream every parent layer's tensors together (default); "
                 "file: the order vLLM's own loader reads, for comparison."),
]
AllowNonfiniteOpt = Annotated[
    bool,
    typer.Option("--allow-nonfinite", help="Accept tensors holding NaN or Inf (refused by default, naming the file "
                 "and tensor)."),
]
BoundedDiskOpt = Annotated[
    bool, typer.Option("--bounded-disk", help="For a Hub repo or a URL: fetch only the tensors the reload hands "
                       "over, into files deleted afterwards; nothing is kept in the Hub cache or layerwise's store "
                       "cache (for a node without room for it).")
]


def check_quantization(method: str | None) -> None:
    """Refuse a quantization method the installed vLLM does not know, as a usage error, before any engine starts."""
    if method is None:
        return
    from layerwise_cli import vllm_compat

    QUANTIZATION_METHODS = vllm_compat.quantization_methods()

    from layerwise_cli.worker.quantization import online_quant  # noqa: F401 - registers layerwise_fp8 / layerwise_int8

    if method not in QUANTIZATION_METHODS:
        from layerwise_cli.errors import UsageError

        raise UsageError(f"--quantization must be one of vLLM's methods ({', '.join(QUANTIZATION_METHODS)}), "
                         f"not {method!r}")
