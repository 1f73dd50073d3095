#!/usr/bin/env bash
# The main job on the built-in default: `layerwise demo`. Sets up .venv first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_venv.sh"
cd "$root"
exec .venv/bin/layerwise demo "$@"
