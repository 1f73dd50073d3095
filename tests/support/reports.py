"""Reload reports for unit tests, built from flat fields named as the report's JSON names them."""

from __future__ import annotations

from dataclasses import fields
from typing import get_type_hints

from layerwise_cli.report.reload_report import SECTIONS, ReloadReport


def report_of(*, layers=(), **flat) -> ReloadReport:
    """A report whose sections take FLAT's fields by name (`wall_s=` goes to `timings`, ...).

    Args:
        layers: the report's `LayerReport`s.
        **flat: the sections' fields, each under its own name (the keys `to_dict` writes).

    Returns:
        The report.

    Raises:
        TypeError: a name no section has (a typo would otherwise be dropped).
    """
    hints = get_type_hints(ReloadReport)
    sections = {}
    for name in SECTIONS:
        section = hints[name]
        sections[name] = section(**{f.name: flat.pop(f.name) for f in fields(section) if f.name in flat})
    if flat:
        raise TypeError(f"no report section has the field(s) {sorted(flat)}")
    return ReloadReport(**sections, layers=layers)
