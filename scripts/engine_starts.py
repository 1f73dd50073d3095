"""A table of the engines and servers each test file starts, and its seconds, slowest first (markdown).

    LAYERWISE_TEST_STARTS=/tmp/starts.txt ./scripts/test.sh --durations=0 | tee /tmp/pytest.txt
    python scripts/engine_starts.py /tmp/starts.txt --durations /tmp/pytest.txt

The starts file has one line per test file (`tests/support/engine_starts.py`); `--durations` sums pytest's
`--durations=0` lines (setup, call and teardown) per file, a second measure of the same seconds.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

KINDS = ("in_process", "engine", "server", "cli_engine", "script")
DURATION = re.compile(r"^\s*([\d.]+)s\s+(?:setup|call|teardown)\s+(?:tests/)?([^:\s]+\.py)::")


def read_starts(path: Path) -> tuple[dict[str, collections.Counter], dict[str, float]]:
    """Per test file: its starts by kind, and its seconds (a file's later line, from a run appended to the same
    file, replaces its earlier one)."""
    starts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: dict[str, float] = collections.defaultdict(float)
    for raw in path.read_text().splitlines():
        words = raw.split()
        if len(words) < 3:
            continue
        name = words[1]
        seconds[name] = float(words[2])
        starts[name] = collections.Counter()
        for word in words[3:]:
            kind, _, count = word.partition("=")
            starts[name][kind] += int(count)
    return starts, seconds


def read_durations(path: Path) -> dict[str, float]:
    """Per test file: the seconds of pytest's `--durations=0` lines about it."""
    out: dict[str, float] = collections.defaultdict(float)
    for raw in path.read_text(errors="replace").splitlines():
        match = DURATION.match(raw)
        if match:
            out[Path(match.group(2)).name] += float(match.group(1))
    return out


def table(starts: dict[str, collections.Counter], seconds: dict[str, float],
          durations: dict[str, float] | None) -> str:
    """The markdown table, the slowest file first; only files that started something, or took 20 s or more."""
    head = ["file", *KINDS, "seconds"] + (["durations s"] if durations is not None else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in sorted(seconds, key=lambda n: -seconds[n]):
        counts = starts[name]
        if not sum(counts.values()) and seconds[name] < 20:
            continue
        cells = [name, *(str(counts.get(kind, 0)) for kind in KINDS), f"{seconds[name]:.0f}"]
        if durations is not None:
            cells.append(f"{durations.get(name, 0.0):.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    total = {kind: sum(c.get(kind, 0) for c in starts.values()) for kind in KINDS}
    rows.append("| all | " + " | ".join(str(total[k]) for k in KINDS) + f" | {sum(seconds.values()):.0f} |"
                + (f" {sum(durations.values()):.0f} |" if durations is not None else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("starts", type=Path, help="the LAYERWISE_TEST_STARTS file")
    parser.add_argument("--durations", type=Path, help="pytest's output with --durations=0")
    args = parser.parse_args(argv)
    starts, seconds = read_starts(args.starts)
    print(table(starts, seconds, read_durations(args.durations) if args.durations else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
