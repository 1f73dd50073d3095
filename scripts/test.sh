#!/usr/bin/env bash
# The whole test suite, against the real CPU engine. Sets up .venv first.
# Two pytest workers (pytest-xdist), one test file at a time each: a file's shared engines stay in one
# worker, and most of an engine's start is spawning and importing processes, which two cores overlap.
# LAYERWISE_TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_venv.sh"
cd "$root"
exec .venv/bin/python -m pytest -n "${LAYERWISE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
