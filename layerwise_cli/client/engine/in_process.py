"""Drive a vLLM engine in this process: start it with layerwise's extension, reload into it."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from layerwise_cli import EXTENSION_CLS, vllm_compat
from layerwise_cli.client.delivery import plan_operation
from layerwise_cli.client.pinning import pin_engine_revision
from layerwise_cli.engine_cpus import BIND_ENV, CoreChoice, choose_cores
from layerwise_cli.engine_defaults import (
    cuda_available,
    default_enforce_eager,
    default_memory_fraction,
    executor_refusal,
)
from layerwise_cli.engine_output import capture_engine_output, start_failure
from layerwise_cli.errors import LayerwiseError, UsageError
from layerwise_cli.report.reload_report import ReloadReport, first_failure, merge_reports
from layerwise_cli.report.verify_result import VerifyResult, merge_verify, verify_failure
from layerwise_cli.vllm_compat import shutdown_engine_core
from layerwise_cli.vllm_logs import quiet_force_kill
from layerwise_cli.worker.rpc import ReloadAnswer, ReloadCall, ReloadOptions, VerifyAnswer, VerifyCall

logger = logging.getLogger("layerwise.engine")


@dataclass
class EngineOptions:
    """The vLLM engine options layerwise passes through, with CPU-friendly defaults.

    Attributes:
        dtype: vLLM's `dtype` (`auto`, `bfloat16`, ...).
        tensor_parallel_size: tensor-parallel workers (on CPU, layerwise binds
            one OpenMP thread group per rank when `VLLM_CPU_OMP_THREADS_BIND` is unset).
        pipeline_parallel_size: pipeline stages; each worker holds (and reloads) only its stage's layers.
        distributed_executor_backend: vLLM's executor: None (its default: processes on this
            machine), `mp`, or `ray` (spans nodes; vLLM runs it on GPU builds only).
        max_model_len: vLLM's `max_model_len` (None: the model's own).
        quantization: vLLM's `quantization` method (online ones included).
        enforce_eager: None: eager on CPU-only machines (a much faster start), graphs on GPU.
        memory_fraction: vLLM's `gpu_memory_utilization` (on CPU: the share of
            host memory for the KV cache); None: 0.1 on CPU, vLLM's default on GPU.
        seed: vLLM's `seed`.
        cpus: on a CPU host, the CPU cores the workers compute on (`0-3`, or
            `0|1` for one list per worker); None: cores no other engine's
            worker on this host holds (`engine_cpus.choose_cores`), unless
            `VLLM_CPU_OMP_THREADS_BIND` is set.
        extra: any other `vllm.LLM` keyword arguments, passed as they are.
    """

    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None
    enforce_eager: bool | None = None
    memory_fraction: float | None = None
    seed: int = 0
    cpus: str | None = None
    extra: dict = field(default_factory=dict)

    def llm_kwargs(self) -> dict:
        """The keyword arguments for `vllm.LLM`, layerwise's worker extension included."""
        on_gpu = cuda_available()
        kwargs = {
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": default_enforce_eager(self.enforce_eager, on_gpu),
            "worker_extension_cls": EXTENSION_CLS,
            "seed": self.seed,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.quantization:
            kwargs["quantization"] = self.quantization
        if self.distributed_executor_backend:
            kwargs["distributed_executor_backend"] = self.distributed_executor_backend
        fraction = default_memory_fraction(self.memory_fraction, on_gpu)
        if fraction is not None:
            kwargs["gpu_memory_utilization"] = fraction
        kwargs.update(self.extra)
        return kwargs


def start_engine(model: str, options: EngineOptions | None = None):
    """Start `vllm.LLM` on MODEL with layerwise's worker extension.

    Args:
        model: a local checkpoint directory or Hub repo id (started at its revision's commit, resolved once
            here: what the engine then holds is that commit, `pinning.pin_engine_revision`).
        options: engine options (CPU-friendly defaults).

    Returns:
        The `vllm.LLM`.

    Raises:
        LayerwiseError: the engine failed to start; the message names the
            exception vLLM's engine or worker process failed with (its
            traceback stays in vLLM's log).
    """
    options = options or EngineOptions()
    workers = options.tensor_parallel_size * options.pipeline_parallel_size
    on_gpu = cuda_available()
    refusal = executor_refusal(options.distributed_executor_backend, on_gpu)
    if refusal:
        raise LayerwiseError(refusal, where=model)
    # vllm-cpu binds one OpenMP thread group per rank (without a binding it refuses several ranks on a
    # single NUMA node), and with its own `auto` every single-rank engine on a host takes the same core.
    cores = None if on_gpu else engine_cores(workers, options.cpus)
    with capture_engine_output() as output, _on_cores(cores):
        try:
            from vllm import LLM  # noqa: PLC0415 - vllm: heavy, only where an engine is driven

            # Registers layerwise's online quantizations (`layerwise_fp8`, `layerwise_int8`) in this process;
            # the engine's processes import the module too (the worker extension imports it).
            from layerwise_cli.worker.quantization import online_quant  # noqa: PLC0415, F401 - loads vllm; registers them here

            llm = LLM(model=model, **pin_engine_revision(model, options.llm_kwargs()))
        except Exception as exc:  # noqa: BLE001 - every start failure becomes one line
            failure = exc
        else:
            output.stop_keeping()
            return llm
    # The engine process logged why it failed; vLLM's exception here often says only "see root cause above".
    raise LayerwiseError(start_failure(failure, output.root_cause()), where=model) from failure


def engine_cores(workers: int, cpus: str | None = None) -> CoreChoice:
    """The cores a new engine of WORKERS ranks on this CPU host gets (`engine_cpus.choose_cores`).

    Logs which cores (logger `layerwise.engine`, INFO) and, when every core is
    taken by other engines' workers, a warning.
    """
    choice = choose_cores(workers, requested=cpus)
    logger.info("vLLM engine: %s", choice.said)
    if choice.warning:
        logger.warning(choice.warning)
    return choice


@contextlib.contextmanager
def _on_cores(choice: CoreChoice | None) -> Iterator[None]:
    """While an engine starts: VLLM_CPU_OMP_THREADS_BIND set to CHOICE's binding (its processes read it then), and the
    starting thread confined to CHOICE's `processes` (the engine's processes inherit it: they start off other
    engines' cores); then both restored."""
    with _bound_to(choice and choice.binding), thread_confined(choice and choice.processes):
        yield


@contextlib.contextmanager
def _bound_to(binding: str | None) -> Iterator[None]:
    """VLLM_CPU_OMP_THREADS_BIND set to BINDING while an engine starts (its processes read it then), then restored."""
    if binding is None:
        yield
        return
    before = os.environ.get(BIND_ENV)
    os.environ[BIND_ENV] = binding
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BIND_ENV, None)
        else:
            os.environ[BIND_ENV] = before


@contextlib.contextmanager
def thread_confined(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """The calling thread on CPUS only (Linux affinity is per thread; a process it starts inherits it), then back."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def stop_engine(llm) -> None:
    """Shut an engine's processes down now, rather than at interpreter exit.

    Call it when done with an engine (in a `finally`): left to interpreter
    exit, Python's multiprocessing waits for vLLM's engine process before
    vLLM's own finalizer stops it, and the script hangs at exit. Never raises:
    an engine already gone is fine.

    Args:
        llm: a `vllm.LLM` (from `start_engine` or built directly).
    """
    try:
        with quiet_force_kill():
            shutdown_engine_core(llm)
    except Exception:  # noqa: BLE001 - best effort: the engine may already be gone
        pass


def ask_workers(llm, call) -> list[dict]:
    """Send CALL (a call of `layerwise_cli.worker.rpc`) to every worker; one JSON answer per worker.

    Raises:
        LayerwiseError: the engine has no layerwise worker extension.
    """
    return call_workers(llm, call.method, **call.kwargs())


def call_workers(llm, method: str, **kwargs) -> list[dict]:
    """Call an extension method on every worker by its name; one result per worker.

    Raises:
        LayerwiseError: the engine has no layerwise worker extension.
    """
    try:
        return llm.collective_rpc(method, kwargs=kwargs)
    except AttributeError as exc:
        raise LayerwiseError(
            f"the engine has no layerwise worker extension ({exc}); build it with "
            f"LLM(..., worker_extension_cls={EXTENSION_CLS!r})"
        ) from exc
    except Exception as exc:
        text = str(exc)
        if vllm_compat.lacks_method(text, method) or ("layerwise_" in text and "not found" in text.lower()):
            raise LayerwiseError(
                f"the engine has no layerwise worker extension; build it with "
                f"LLM(..., worker_extension_cls={EXTENSION_CLS!r})"
            ) from exc
        raise


def reload(llm, source: str, *, verify: bool = False, options: ReloadOptions | None = None,
           **option_values) -> ReloadReport:
    """Reload SOURCE into a running `vllm.LLM`, in layer order, and report what it cost.

    The engine must have been built with
    `worker_extension_cls="layerwise_cli.worker.extension.LayerwiseWorkerExtension"`
    (`layerwise_cli.EXTENSION_CLS`). Every worker checks the checkpoint against
    its model first; if any check fails nothing is loaded. The engine's
    scheduler is paused with its caches cleared for the reload (requests in
    flight are aborted) and resumed after, as vLLM asks before a weight update.

    Args:
        llm: the engine.
        source: a checkpoint directory or file the workers can read, or a Hub repo id.
        verify: after the reload, check on every worker, layer by layer (and
            every module derived from a layer, such as a tied head), that the
            engine holds exactly what vLLM makes of SOURCE (`verify_engine`).
        options: how to reload, a `ReloadOptions` (`layerwise_cli.ReloadOptions`); or give its fields as
            keywords (`order="file", allow_partial=True`), not both. Its fields:
            `order`: `layer` (default) or `file` (vLLM's own read order, for comparison).
            `allow_partial`: accept a checkpoint that covers only some parameters.
            `readahead`: read the next layer while the engine processes the current one.
            `revision`: a Hub repo id's branch, tag or commit: resolved to its commit once, first, and every
            worker, the verification and any rollback read that commit (`report.placement.commit` names it).
            For a URL source, the pin of its objects (`etags:<16 hex>`, read here when None).
            `progress_path`: a file the first worker appends per-layer progress to.
            `allow_nonfinite`: load tensors holding NaN or Inf (by default refused,
            naming the file and tensor, and the engine rolled back).
            `all_layers`: hand every parent layer to vLLM. By default a layer the
            engine already holds is skipped: its source digest (from the
            shard headers, else hashed as read) equals the one each worker
            recorded when layerwise last loaded it, and its state in the
            engine has not changed since (`report.unchanged.skipped_layers`).
            `allow_unchecked`: with `verify`, accept layers (or derived buffers)
            that could not be checked; by default they fail the verification.
            With or without `verify`, also keep a reload whose completion could
            not be shown: vLLM could not load a layer it was handed (those keep
            their previous weights), a buffer derived at load was left stale, or
            the measured buffer peak is not the prediction. The report notes what
            was accepted; by default such a reload is rolled back.
        **option_values: `ReloadOptions`' fields as keywords, when `options` is not given.

    Returns:
        The merged report of all workers; with `verify`, `report.verify` holds
        the (passed) verification.

    Raises:
        LayerwiseError: pre-flight or the reload failed (the engine keeps, or is
            rolled back to, the weights it had); or, with `verify`, a layer
            differs from SOURCE or could not be checked (the message names the
            layers; the engine then holds SOURCE's weights, unverified: call
            `verify_engine` for the full result); or a tensor holds NaN or Inf
            (refused and rolled back unless `allow_nonfinite`); or vLLM could
            not load a layer it was handed (rolled back, the layers named,
            unless `allow_unchecked`).
        UsageError: both `options` and option keywords were given.
    """
    if options is None:
        options = ReloadOptions(**option_values)
    elif option_values:
        raise UsageError("give either options= or option keywords, not both")
    # A Hub repo id is read at one commit, resolved here, by every worker, the verification and any rollback.
    options, _pin = plan_operation(source, options)
    per_worker = reload_workers(llm, source, options)
    verification = None
    if verify:
        verification = verify_engine(llm, source, options.revision, allow_unchecked=options.allow_unchecked)
        if not verification.ok:
            raise LayerwiseError(f"{verify_failure(verification)}; the engine holds the reloaded weights, unverified",
                                 where=source)
    return merge_reports(per_worker, verify=verification)


def reload_workers(llm, source: str, options: ReloadOptions) -> list[ReloadReport]:
    """Reload SOURCE on every worker of LLM and reset its prefix cache; the workers' own reports.

    `reload` without verification or merging.

    Args:
        llm: the engine (see `reload`).
        source: a checkpoint directory or file the workers can read, or a Hub repo id.
        options: how to reload (see `reload`); the diagnostic switches set in this process are added
            (`ReloadOptions.with_switches`).

    Returns:
        One report per worker, in rank order.

    Raises:
        LayerwiseError: a worker failed (its one-line error; see `reload`).
    """
    # Paused with its caches cleared, as vLLM asks before a weight update: KV blocks cached under the old weights
    # must not serve prompts under the new ones, and vLLM 0.34's extensible KV cache (the CUDA default) lends the
    # reload its memory only when it holds nothing to keep.
    vllm_compat.pause_engine_core(llm)
    try:
        results = ask_workers(llm, ReloadCall(source=source, options=options.with_switches()))
    finally:
        vllm_compat.resume_engine_core(llm)
    per_worker = worker_reports(results)
    # KV blocks cached under the old weights must not serve prompts under the new ones.
    llm.reset_prefix_cache()
    return per_worker


def verify_engine(llm, source: str, revision: str | None = None, *, allow_unchecked: bool = False) -> VerifyResult:
    """Check, on every worker of an in-process engine, that it holds exactly what SOURCE must produce.

    Args:
        llm: a `vllm.LLM` built with layerwise's worker extension.
        source: the checkpoint the engine should hold (a path the workers read, a Hub repo id, or a URL).
        revision: its pin: a Hub repo id's commit (or a branch or tag, read as it is now), a URL's
            `etags:<16 hex>` (None: the objects as they are now).
        allow_unchecked: layers (or derived buffers) that could not be checked
            do not make `ok` False (the result says they were accepted).

    Returns:
        The merged result; `ok` is False when a layer differs or could not be checked.

    Raises:
        LayerwiseError: the check itself could not run.
    """
    start = time.perf_counter()
    answers = [VerifyAnswer.from_json(r) for r in ask_workers(llm, VerifyCall(source=source, revision=revision))]
    failures = [a for a in answers if not a.ok]
    if failures or not answers:
        error = (failures[0].error or "a worker failed without saying why") if failures else "no workers"
        raise LayerwiseError(f"--verify could not run: {error}", where=source)
    return merge_verify([a.verify for a in answers], wall_s=time.perf_counter() - start,
                        allow_unchecked=allow_unchecked)



def worker_reports(results: list[dict]) -> list[ReloadReport]:
    """Each worker's report from its `layerwise_reload` answer, raising the first-hand failure if any failed."""
    error = first_failure(results)
    if error is not None:
        raise LayerwiseError(error)
    return [ReloadReport.from_dict(ReloadAnswer.from_json(r).report) for r in results]


def reports_from_results(results: list[dict]) -> ReloadReport:
    """The merged report of the workers' `layerwise_reload` answers, raising the first-hand failure if any failed."""
    return merge_reports(worker_reports(results))
