#!/usr/bin/env bash
# The whole test suite, against the real CPU engine. Sets up .venv first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_venv.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
