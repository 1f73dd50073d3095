#!/usr/bin/env bash
# The whole test suite, against the real CPU engine. Sets up .venv first.
# Two pytest workers (pytest-xdist), one test file at a time each: a file's shared engines stay in one
# worker, and most of an engine's start is spawning and importing processes, which two cores overlap.
# LAYERWISE_TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_venv.sh"
cd "$root"
# The repository's modules compiled to bytecode once, before the run: every server, engine process and command
# the tests start imports them, and where PYTHONDONTWRITEBYTECODE is set (as on this machine) each of those
# processes would otherwise compile them again (about 1.3 s of CPU for a server's plugin and worker modules).
# A module edited later is compiled in memory as before: stale bytecode is never used.
.venv/bin/python -m compileall -q -j 0 layerwise_cli tests examples scripts benchmarks >/dev/null
exec .venv/bin/python -m pytest -n "${LAYERWISE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
