#!/usr/bin/env bash
# The GPU check: one command on a machine with one NVIDIA GPU and the `vllm` package.
#
#     bash scripts/gpu_check.sh                 # results in bench-out/gpu/
#
# The benchmark takes about 9 minutes, engine starts included (budget
# $LAYERWISE_GPU_BUDGET_S, default 540 s); the GPU tests come after it with
# their own limit ($LAYERWISE_GPU_TEST_TIMEOUT_S, default 360 s; each of them
# starts engines of its own). LAYERWISE_GPU_SKIP_TESTS=1 skips them;
# LAYERWISE_GPU_SKIP_DELTA=1 skips the delta run (2d).
#  1. Python: $LAYERWISE_GPU_PYTHON if set, else the venv $LAYERWISE_GPU_VENV
#     (default .venv-gpu), created with --system-site-packages so that an
#     installed `vllm` is reused; `pip install vllm` only when none is
#     importable (that needs the network). This package goes in without
#     dependencies (vllm brings all that the benchmark needs); if that is not
#     possible offline, PYTHONPATH points at the checkout instead.
#  1b. The writer from a CUDA state dict (`tests/test_writer_logic.py -m gpu`, no
#     engine, seconds): first, so that it runs whatever the benchmark takes.
#  2. benchmarks/bench_reload.py on an 8B-sized synthetic checkpoint (Qwen3-8B
#     shapes: hidden 4096, 36 layers, intermediate 12288, 32/8 heads,
#     head_dim 128, vocab 151936; 16.4 GB bf16) in two orders (in order and
#     trainer export), written once to /dev/shm (or $TMPDIR when /dev/shm is
#     too small): first a bf16 engine, then an engine with vLLM's online FP8
#     quantization (`fp8_per_tensor`; plain `fp8` on vLLMs older than that
#     name), each printing the benchmark table. Each run has a time budget and
#     does as many timed runs as fit (at least one).
#  2d. The delta cases (reload only what changed: f 25% of layers changed, g
#     identical with and g-plain without header digests, h save_checkpoint's
#     output), bf16, on a 4 GiB checkpoint in its own folder, written after the
#     8B ones are removed: base, f, g-plain and h take 4 copies (5 while the
#     writer spills), where 8B shapes would not fit /dev/shm.
#  3. `pytest -m gpu` on the test files that carry the gpu marker, if any: vLLM's online FP8
#     (`fp8_per_block` dense, `fp8_per_tensor` MoE) A -> B -> A against a fresh FP8 engine, with the
#     measured peak against the prediction and --verify re-quantizing every FP8 layer (tests/test_gpu_engine.py).
# Exit status: 1 if a benchmark or the GPU tests failed, else 0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
t0=$SECONDS
total_budget=${LAYERWISE_GPU_BUDGET_S:-540}
test_timeout=${LAYERWISE_GPU_TEST_TIMEOUT_S:-360}
out="${LAYERWISE_GPU_OUT:-$root/bench-out/gpu}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
status=0

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L failed)" >&2
    exit 1
fi
nvidia-smi -L >&2

# 1. Python with vllm (GPU build) and this package.
if [[ -n "${LAYERWISE_GPU_PYTHON:-}" ]]; then
    py="$LAYERWISE_GPU_PYTHON"
else
    venv="${LAYERWISE_GPU_VENV:-$root/.venv-gpu}"
    if [[ ! -x "$venv/bin/python" ]]; then
        "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
    fi
    py="$venv/bin/python"
fi
if ! "$py" -c "import vllm" >/dev/null 2>&1; then
    echo "gpu_check: installing vllm into $("$py" -c 'import sys; print(sys.prefix)') (needs the network)" >&2
    "$py" -m pip install --quiet vllm >&2
fi
if ! "$py" -c "import layerwise_cli, sys; sys.exit(0 if layerwise_cli.__file__.startswith('$root') else 1)" \
        >/dev/null 2>&1; then
    "$py" -m pip install --quiet --no-deps --no-build-isolation -e "$root" >&2 \
        || echo "gpu_check: could not install layerwise; using PYTHONPATH" >&2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" - >&2 <<'EOF'
import torch, vllm
assert torch.cuda.is_available(), "torch sees no GPU"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF
# 1b. The writer from a CUDA state dict (no engine).
echo "== save_checkpoint from CUDA tensors" >&2
timeout --kill-after=10 120 "$py" -m pytest -m gpu -q -p no:cacheprovider tests/test_writer_logic.py >&2 || status=1

# vLLM 0.32 moved online FP8 from `fp8` to `fp8_per_tensor` / `fp8_per_block`.
fp8="$("$py" -c "
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS as m
print('fp8_per_tensor' if 'fp8_per_tensor' in m else 'fp8')")"

# 2. Checkpoints: 2 x 16.4 GB, in /dev/shm when it has room (tmpfs pages are the page cache).
need=$((36 * 1024 * 1024))  # KiB: two checkpoints and some slack
base=/dev/shm
if [[ ! -w /dev/shm ]] || (( $(df -Pk /dev/shm | awk 'NR==2 {print $4}') < need )); then
    base="${TMPDIR:-/tmp}"
fi
work="$base/layerwise-gpu-check"
trap 'rm -rf "$work"' EXIT
common=(--preset qwen3-8b --layouts in_order,trainer_export --cases "" --max-model-len 512 --workdir "$work"
        --keep --out "$out")

left() { echo $(( total_budget - (SECONDS - t0) )); }

# bf16 first (it also writes the checkpoints), then FP8, then the delta cases, with what is left.
budget=$(( $(left) * 45 / 100 ))
echo "== bf16 (budget ${budget}s)" >&2
timeout --kill-after=20 $(( budget + 60 )) "$py" -m benchmarks.bench_reload "${common[@]}" --runs 5 \
    --time-budget "$budget" --label gpu_bf16 || status=1

budget=$(( $(left) * 45 / 100 ))
[[ "${LAYERWISE_GPU_SKIP_DELTA:-0}" == 1 ]] && budget=$(( $(left) - 10 ))
if (( budget < 120 )); then
    echo "gpu_check: only ${budget}s left of the budget: FP8 skipped (raise LAYERWISE_GPU_BUDGET_S)" >&2
    status=1
else
    echo "== online FP8: quantization=$fp8 (budget ${budget}s)" >&2
    timeout --kill-after=20 $(( budget + 30 )) "$py" -m benchmarks.bench_reload "${common[@]}" --runs 5 \
        --variants a,b,c,d,e --quantization "$fp8" --time-budget "$budget" --label gpu_fp8 || status=1
fi

# 2d. The delta cases on a 4 GiB checkpoint (its own folder; the 8B checkpoints are removed first).
rm -rf "$work"
budget=$(( $(left) - 10 ))
if [[ "${LAYERWISE_GPU_SKIP_DELTA:-0}" == 1 ]]; then
    echo "== delta cases skipped (LAYERWISE_GPU_SKIP_DELTA=1)" >&2
elif (( budget < 120 )); then
    echo "gpu_check: only ${budget}s left of the budget: delta cases skipped (raise LAYERWISE_GPU_BUDGET_S)" >&2
    status=1
else
    echo "== delta cases, bf16, 4 GiB (budget ${budget}s)" >&2
    timeout --kill-after=20 $(( budget + 30 )) "$py" -m benchmarks.bench_reload --size-gib 4 --layouts in_order \
        --variants a,c,d --cases f,g,g-plain,h --max-model-len 512 --workdir "$work/delta-run" --out "$out" \
        --runs 5 --time-budget "$budget" --label gpu_delta || status=1
    rm -rf "$work"
fi

echo "gpu_check: benchmark done in $(( SECONDS - t0 ))s" >&2

# 3. GPU tests, if any exist (after the benchmark, with their own limit).
mapfile -t gpu_tests < <(grep -rlE "mark\.gpu\b" tests/ --include='test_*.py' || true)
if [[ "${LAYERWISE_GPU_SKIP_TESTS:-0}" == 1 ]]; then
    echo "== GPU tests skipped (LAYERWISE_GPU_SKIP_TESTS=1)" >&2
elif (( ${#gpu_tests[@]} )); then
    if ! "$py" -c "import pytest" >/dev/null 2>&1; then
        "$py" -m pip install --quiet pytest >&2 || true
    fi
    echo "== pytest -m gpu ${gpu_tests[*]} (limit ${test_timeout}s)" >&2
    t1=$SECONDS
    timeout --kill-after=15 "$test_timeout" "$py" -m pytest -m gpu -q -p no:cacheprovider "${gpu_tests[@]}" \
        || status=1
    echo "gpu_check: GPU tests took $(( SECONDS - t1 ))s" >&2
else
    echo "== no tests with the gpu marker" >&2
fi
echo "gpu_check: done in $(( SECONDS - t0 ))s; results in $out" >&2
exit $status
