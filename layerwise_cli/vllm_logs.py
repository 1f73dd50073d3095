"""Drop the vLLM log lines known to be harmless around a layerwise reload; every other line passes.

Logger filters sit on the loggers that emit the lines, so vLLM's own logging
configuration (handlers, levels, streams) stays as it is, and the filter
works in whichever process logs: the engine's workers import this through
the worker extension, the `layerwise` process around `stop_engine`.
`LAYERWISE_DEBUG=1` lets everything through.

`quiet_engine_notes` goes further for `layerwise demo`: it hides every warning
and note of vLLM's (and torch's) in the engine's processes, errors kept.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from layerwise_cli import vllm_compat

# Every reload: vLLM's layerwise reload finds no checkpoint tensors for the
# rotary cache (it is computed, never stored), puts it back unchanged and
# warns "RotaryEmbedding: Failed to load weights". Other layers keep the warning.
RELOAD_LOGGER = vllm_compat.RELOAD_LOGGER
# After a reload that left layers out: "Following weights were not loaded from checkpoint: {...}".
INPLACE_LOGGER = vllm_compat.INPLACE_LOGGER
# Stopping an engine: vLLM's process manager SIGKILLs an engine process still
# alive 5 s after SIGTERM, and says so, then names each of its worker
# processes as `kill_process_tree` kills them (another logger); `stop_engine`
# wants them gone either way.
SHUTDOWN_LOGGER = vllm_compat.SHUTDOWN_LOGGER
KILL_TREE_LOGGER = vllm_compat.KILL_TREE_LOGGER
_FORCE_KILL = ("[shutdown] Process manager: force killing", "[shutdown] force killing sub process")


def _debug() -> bool:
    return os.environ.get("LAYERWISE_DEBUG", "") not in {"", "0"}


def is_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """The per-reload `<Rotary...Embedding>: Failed to load weights` warning."""
    args = record.args if isinstance(record.args, tuple) else ()
    return (record.msg == "%s: Failed to load weights" and len(args) == 1
            and str(args[0]).endswith("RotaryEmbedding"))


def is_force_kill_notice(record: logging.LogRecord) -> bool:
    """vLLM's `[shutdown] Process manager: force killing ...` and `[shutdown] force killing sub process ...` lines."""
    return str(record.msg).startswith(_FORCE_KILL)


class _Drop(logging.Filter):
    def __init__(self, test) -> None:
        super().__init__()
        self.test = test

    def filter(self, record: logging.LogRecord) -> bool:
        return _debug() or not self.test(record)


_ROTARY_FILTER = _Drop(is_rotary_reload_warning)


def silence_rotary_reload_warning() -> None:
    """Install the rotary-cache filter in this process (idempotent); the worker extension calls it on import."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if _ROTARY_FILTER not in logger.filters:
        logger.addFilter(_ROTARY_FILTER)


@contextmanager
def quiet_force_kill() -> Iterator[None]:
    """Drop vLLM's force-kill notices while a deliberate shutdown runs in this process."""
    with _dropping(_Drop(is_force_kill_notice), SHUTDOWN_LOGGER, KILL_TREE_LOGGER):
        yield


@contextmanager
def quiet_skipped_layer_warnings(skipped: Callable[[], Counter]) -> Iterator[None]:
    """Drop vLLM's warnings about the layers a reload skipped on purpose (unchanged since layerwise loaded them).

    vLLM warns `<Class>: Failed to load weights` for each layer that got no
    tensor (and puts it back as it was), then lists every parameter not
    loaded. While this runs, up to `skipped()[Class]` of the first are dropped
    per class, and the list is dropped once anything was skipped; other
    layers keep their warnings.

    Args:
        skipped: class name -> layers of that class skipped so far (read when a line is logged).
    """
    dropped: Counter = Counter()

    def test(record: logging.LogRecord) -> bool:
        if record.name == INPLACE_LOGGER:
            return str(record.msg).startswith("Following weights were not loaded") and sum(skipped().values()) > 0
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg != "%s: Failed to load weights" or len(args) != 1:
            return False
        name = str(args[0])
        if dropped[name] < skipped().get(name, 0):
            dropped[name] += 1
            return True
        return False

    with _dropping(_Drop(test), RELOAD_LOGGER, INPLACE_LOGGER):
        yield


@contextmanager
def _dropping(drop: logging.Filter, *names: str) -> Iterator[None]:
    """Install DROP on the named loggers for the duration of the block."""
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


# `layerwise demo` without --verbose: vLLM's warnings and notes (Triton, NUMA binding, tcmalloc, the model
# runner) hidden in every process of the engine, errors kept. Set in the environment, so that the engine's
# processes (spawned, with this environment) start quiet too.
QUIET_ENV = "LAYERWISE_QUIET_ENGINE"
_QUIET_ENVIRONMENT = {
    # vLLM's own loggers in every process.
    "VLLM_LOGGING_LEVEL": "ERROR",
    # torch's C++ warnings (`[W... utils.cpp] Warning: NUMA binding ...`).
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # vLLM 0.32's own use of a deprecated torch name, warned in each worker.
    "PYTHONWARNINGS": "ignore::FutureWarning:vllm.triton_utils.dispatcher",
}
# Loggers vLLM writes to at import, before its logging is configured (Python's last-resort handler prints them,
# whatever VLLM_LOGGING_LEVEL says): "Triton is installed, but doesn't include CPU backend".
_EARLY_LOGGERS = ("vllm.triton_utils.importing",)


def quiet_engine_notes(options):
    """OPTIONS for an engine that prints only errors: vLLM's warnings and notes hidden in this process and in
    the engine's (through the environment), vLLM's progress bar for loading off. `LAYERWISE_DEBUG=1` keeps them.

    Args:
        options: the `EngineOptions` to start the engine with.

    Returns:
        OPTIONS, with `use_tqdm_on_load=False` among its extra vLLM arguments unless LAYERWISE_DEBUG is set.
    """
    if _debug():
        return options
    os.environ.update(_QUIET_ENVIRONMENT)
    os.environ[QUIET_ENV] = "1"
    quiet_early_loggers()
    return replace(options, extra={**options.extra, "use_tqdm_on_load": False})


def quiet_early_loggers() -> None:
    """Under LAYERWISE_QUIET_ENGINE=1, raise the loggers vLLM writes to before its logging is configured to
    ERROR in this process (the CLI's module calls this on import, which is also how an engine process spawned
    from the `layerwise` script starts)."""
    if os.environ.get(QUIET_ENV) == "1" and not _debug():
        for name in _EARLY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
