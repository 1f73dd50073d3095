"""Reports as plain JSON data: frozen reports keep sequences as tuples, JSON has lists."""

from __future__ import annotations


def jsonable(value: object) -> object:
    """VALUE with every tuple turned into a list, recursively: what `json.loads(json.dumps(VALUE))` gives back.

    Args:
        value: a report's `dataclasses.asdict`, or any nesting of dicts, lists and tuples.

    Returns:
        The same data with lists in place of tuples (dicts and other values as they are).
    """
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value
