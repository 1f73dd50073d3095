"""State a worker keeps between reloads, on the worker extension's instance (it lives as long as the process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def kept_on(worker, attribute: str, make: Callable[[], T]) -> T:
    """The object WORKER keeps under ATTRIBUTE, made by MAKE on first use."""
    value = getattr(worker, attribute, None)
    if value is None:
        value = make()
        setattr(worker, attribute, value)
    return value
