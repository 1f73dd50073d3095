#!/usr/bin/env bash
# Run the Hub tests against the oldest huggingface_hub that pyproject.toml
# allows (`huggingface_hub>=FLOOR`), in a small throw-away venv with only
# layerwise's light dependencies (no torch, no vLLM): proves the floor.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
floor="$(sed -n 's/^ *"huggingface_hub>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)"
if [[ -z "$floor" ]]; then
    echo "test_hub_floor.sh: no \"huggingface_hub>=X\" in pyproject.toml" >&2
    exit 1
fi
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
venv="$(mktemp -d "${TMPDIR:-/tmp}/layerwise-hub-floor.XXXXXX")"
trap 'rm -rf "$venv"' EXIT
echo "Hub tests against huggingface_hub==$floor (the floor in pyproject.toml) ..." >&2
"$python" -m venv "$venv"
# No pip cache: the run must not depend on one.
# layerwise's own dependencies as pyproject.toml lists them (huggingface_hub
# pinned to the floor), plus the test tools.
mapfile -t deps < <("$python" -c '
import tomllib
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not dep.replace("-", "_").startswith("huggingface_hub"):
        print(dep)')
PIP_NO_CACHE_DIR=1 "$venv/bin/python" -m pip install --quiet \
    "${deps[@]}" pytest hypothesis "huggingface_hub==$floor" >&2
"$venv/bin/python" -c "import huggingface_hub as h; assert h.__version__ == '$floor', h.__version__" 
# layerwise from this checkout, not installed: the venv holds only what it depends on.
PYTHONPATH="$root" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_hub_cli.py tests/test_hub_fetch_logic.py tests/test_hub_fetch_server.py tests/test_watch_hub_logic.py \
    tests/test_reorder_engine.py::test_hub_source_fetches_shards_one_at_a_time "$@"
