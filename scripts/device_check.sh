#!/usr/bin/env bash
# The device check: layerwise's reader into GPU memory, measured, on a machine with one NVIDIA GPU and NO vLLM.
#
#     bash scripts/device_check.sh                 # results in $OUT, else bench-out/device
#     bash scripts/device_check.sh --runs 1 --layouts in_order     # extra options go to the core
#
# It runs benchmarks/device_check.py on this machine's own python3 against the tree as it is (the
# package is pure Python: nothing is installed; PYTHONPATH points at the checkout). It needs torch
# with CUDA, safetensors, xxhash and numpy, and never imports vLLM. What it does and what it
# measures: docs/device-check.md. It is sized to finish in 8 minutes of wall time, set-up
# included: the core gets a budget of $LAYERWISE_DEVICE_BUDGET_S (default 400 s) and skips (and
# lists) what would not fit; a hard limit of $LAYERWISE_DEVICE_LIMIT_S (default 450 s) stops it
# in any case (the JSON written after each phase stays).
#   LAYERWISE_DEVICE_PYTHON   the interpreter (default python3)
#   LAYERWISE_DEVICE          the device (default cuda; cpu runs the same core without a GPU)
# Exit status: the core's (0: everything ran and every byte check passed), 1 when it could not start.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
t0=$SECONDS
py="${LAYERWISE_DEVICE_PYTHON:-python3}"
device="${LAYERWISE_DEVICE:-cuda}"
budget="${LAYERWISE_DEVICE_BUDGET_S:-400}"
limit="${LAYERWISE_DEVICE_LIMIT_S:-450}"
out="${OUT:-$root/bench-out/device}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

if [[ "$device" == cuda* ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >&2; then
        echo "device_check: no NVIDIA GPU here (nvidia-smi -L failed); LAYERWISE_DEVICE=cpu runs the CPU path" >&2
        exit 1
    fi
fi
if ! "$py" - >&2 <<PYEOF
import sys
import numpy, safetensors, torch, xxhash
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"safetensors {safetensors.__version__}, xxhash {xxhash.VERSION}, numpy {numpy.__version__}")
if "$device".startswith("cuda") and not torch.cuda.is_available():
    sys.exit("device_check: torch sees no GPU (torch.cuda.is_available() is False)")
PYEOF
then
    exit 1
fi
tmp="${TMPDIR:-/tmp}"
df -h "$tmp" /dev/shm >&2 || true
echo "device_check: set-up took $(( SECONDS - t0 ))s; budget ${budget}s, limit ${limit}s, results in $out" >&2
status=0
# The core's progress goes to stderr and into $out/device_check.log (a caller may see only the tail of stderr).
timeout --kill-after=15 "$limit" "$py" -m benchmarks.device_check --device "$device" \
    --time-budget "$budget" --out "$out" "$@" 2> >(tee "$out/device_check.log" >&2) || status=$?
if (( status == 124 || status == 137 )); then
    echo "device_check: stopped at the ${limit}s limit; $out holds what was measured until then" >&2
fi
echo "device_check: done in $(( SECONDS - t0 ))s (exit $status); results in $out" >&2
exit $status
