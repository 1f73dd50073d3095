"""Loggers held at one level for a test, whatever an earlier test in the same worker configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loggers_at(level: int, *names: str) -> Iterator[list[logging.Logger]]:
    """Set the loggers NAMES and their parent `vllm` to LEVEL for the block, then restore them.

    vLLM configures its logging when an engine starts, from VLLM_LOGGING_LEVEL at that moment: after an
    in-process `layerwise demo` (which sets it to ERROR) a later test in the same worker sees vLLM's
    warnings dropped before any handler or filter runs. A test of what filters keep sets the level it needs.

    Args:
        level: the level, e.g. `logging.WARNING`.
        names: the loggers' names.

    Yields:
        the loggers, in the order of NAMES.
    """
    loggers = [logging.getLogger(name) for name in (*names, "vllm")]
    before = [(logger.level, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
        logger.disabled = False
    try:
        yield loggers[:len(names)]
    finally:
        for logger, (old_level, disabled) in zip(loggers, before):
            logger.setLevel(old_level)
            logger.disabled = disabled
