#!/usr/bin/env bash
# Builds jax-ep with the CUDA backend on a GPU machine, runs the GPU tests, the GPU
# benchmark and the harness timing, and prints a short table last. Meant for one
# H200 (or H100) in well under 8 minutes.
#
#   bash scripts/gpu_check.sh            # OUT=<dir> keeps logs and JSON results there
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/jax_ep_gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# The harness and the communication buffers are allocated outside XLA's pool.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
start=$(date +%s)

echo "== GPU"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== build (JAX_EP_CUDA=ON)"
VENV="$OUT/venv"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
JAX_EP_CUDA=ON "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . \
  >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
"$VENV/bin/python" -c "import jax, jax_ep; print(jax_ep.build_info(), jax.devices())"

echo "== GPU tests"
timeout 240 "$VENV/bin/python" -m pytest -q -rs -m gpu tests/runtime/test_cuda.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark (python -m jax_ep.bench, 8 virtual ranks on GPU 0 through the harness)"
# reference is skipped there (a shard_map needs one device per rank); the table says so.
timeout 150 "$VENV/bin/python" -m jax_ep.bench --virtual-ranks --ranks 8 --tokens 4096 \
  --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 --repeats 3 --no-progress \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== harness timing"
timeout 180 "$VENV/bin/python" scripts/cuda_harness_bench.py --json "$OUT/harness.json" \
  2>&1 | tee "$OUT/harness.log"
harness_rc=${PIPESTATUS[0]}

echo
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, harness rc=$harness_rc, $(( $(date +%s) - start )) s"
# The table comes last.
sed -n '/^virtual-rank harness/,$p' "$OUT/harness.log"
[ "$tests_rc" -eq 0 ] && [ "$harness_rc" -eq 0 ]
