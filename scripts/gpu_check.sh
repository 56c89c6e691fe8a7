#!/usr/bin/env bash
# The GPU check of jax-ep, for one lent H200 (or H100), in one call of under 9 minutes:
# builds the CUDA backend into the machine's own Python, runs the kernels every way one
# GPU allows, and prints a table last. Each stage is time-boxed and writes its log under
# $OUT; all stage results go to $OUT/gpu_check.json and the table to $OUT/summary.txt
# (8 files at most). A failing stage never stops the later ones (except a failed build).
#
#   bash scripts/gpu_check.sh              # every stage
#   bash scripts/gpu_check.sh --only 3     # stage 3 (or its name), after stage 1 if needed
#   bash scripts/gpu_check.sh --dry-run    # stage 1 for real, then each stage's plan
#
# Stages (budget in seconds):
#   1 build       pip install --no-build-isolation --no-deps -e . with JAX_EP_CUDA=ON into
#                 $PYTHON (default python3: on the lent machine a virtualenv that already has
#                 jax, nanobind, scikit-build-core, NVSHMEM; no venv is made, nothing is
#                 downloaded); retried without NVSHMEM if that build fails; build_info()
#   2 tests       GPU tests: virtual-rank harness bit-exact vs the CPU oracle (dispatch,
#                 combine, gather, layout, every dtype, overflow, empty ranks), concurrent
#                 harness mode, call-site and timeout checks, reset(), real handlers
#   3 multiprocess  R = 2 and 4 processes on the GPU (CUDA IPC; MPS when available):
#                 dispatch, combine, gradients bit-exact vs CPU; one process killed
#   4 internode   NVSHMEM PEs (2 and 4) on the GPU, bit-exact vs CPU (skipped without NVSHMEM)
#   5 sanitizer   compute-sanitizer memcheck, racecheck, synccheck on a small harness run
#   6 bench       python -m jax_ep.bench --virtual-ranks, and the harness timing
#
# Environment: OUT (default /tmp/jax_ep_gpu_check), PYTHON (default python3),
# JAX_EP_BUILD_LOCK (a lock file to hold while building, e.g. /tmp/jaxep.build.lock),
# JAX_EP_GPU_CHECK_MPS=0 (do not start CUDA MPS).
#
# Not part of this one-GPU check: the per-port proof needs two nodes with RDMA NICs. On
# each node, around the internode benchmark (docs/internode.md, "Proof on hardware"):
#   python -m jax_ep.network.fabric --gpu <GPU bus id>          # class, selected ports
#   python -m jax_ep.network.portcheck --gpu <GPU bus id> --tolerance 0.1 -- <benchmark>
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }

DRY=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY="${2:-}"; shift ;;
    --only=*) ONLY="${1#*=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'"; usage; exit 2 ;;
  esac
  shift
done

NAMES=(build tests multiprocess internode sanitizer bench)
BUDGETS=(160 90 70 70 60 60)
OVERHEAD=20     # GPU query, MPS start/stop, the report
LIMIT=540       # 9 minutes: one device call must end well inside its 10

if [ -n "$ONLY" ]; then
  for i in "${!NAMES[@]}"; do
    [ "$ONLY" = "${NAMES[$i]}" ] && ONLY=$((i + 1))
  done
  case "$ONLY" in
    [1-6]) ;;
    *) echo "gpu_check: --only takes 1-6 or one of: ${NAMES[*]}"; exit 2 ;;
  esac
fi

export OUT="${OUT:-/tmp/jax_ep_gpu_check}"
# Scratch outside $OUT: only logs, the JSON and the table come back from the machine.
export WORK="${JAX_EP_GPU_CHECK_WORK:-/tmp/jax_ep_gpu_check_work}"
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK"
export PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Several processes share the GPU and the harness allocates outside XLA's pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
# The CPU oracle in the tests runs on virtual CPU devices.
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

# ------------------------------------------------------------------------------ stages
# Each runs in its own bash under `timeout`; it may write WORK/sN.status (a status that
# replaces "pass", e.g. a skip), WORK/sN*.json, WORK/sN*.xml (junit) or WORK/sN.tools.

stage_build() {
  echo "python: $PY -> $("$PY" -c 'import sys; print(sys.version.split()[0], sys.prefix)')"
  echo "nvcc: $(command -v nvcc || echo missing) $(nvcc --version 2>/dev/null | tail -1)"
  local lock=()
  if [ -n "${JAX_EP_BUILD_LOCK:-}" ] && command -v flock >/dev/null 2>&1; then
    lock=(flock -w 400 "$JAX_EP_BUILD_LOCK")
  fi
  export JAX_EP_CUDA=ON
  local pip=("$PY" -m pip install --no-build-isolation --no-deps --no-index -e .)
  if ! ${lock[@]+"${lock[@]}"} "${pip[@]}"; then
    echo "gpu_check: the build with the NVSHMEM internode backend failed; retrying without it"
    ${lock[@]+"${lock[@]}"} "${pip[@]}" --config-settings=cmake.define.JAX_EP_NVSHMEM=OFF || return 1
    echo "built without NVSHMEM (the build with it failed; see above)" >"$WORK/s1.status"
  fi
  "$PY" - "$WORK/s1.json" <<'EOF'
import importlib.metadata as md, json, sys
import jax, jax_ep
info = jax_ep.build_info()
res = {"build_info": info, "jax": jax.__version__, "python": sys.version.split()[0],
       "devices": [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]}
try:
    res["nvshmem_wheel"] = md.version("nvidia-nvshmem-cu13")
except md.PackageNotFoundError:
    res["nvshmem_wheel"] = None
try:
    from jax_ep.backends import internode
    rep = internode.transport_report() if hasattr(internode, "transport_report") else {}
    res["nvshmem_versions"] = {k: rep.get(k) for k in ("headers_version", "runtime_version")}
except Exception as e:  # noqa: BLE001 - reported, not fatal
    res["nvshmem_versions"] = f"unavailable: {e}"
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
print("build_info:", json.dumps(info))
print("NVSHMEM: wheel", res["nvshmem_wheel"], "versions", res["nvshmem_versions"])
print("devices:", res["devices"])
sys.exit(0 if info["cuda"] else 1)
EOF
}

stage_tests() {
  local rc=0 r
  timeout -k 3 64 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime/test_cuda.py \
    --junitxml="$WORK/s2.xml" || rc=1
  # The low-latency kernels' harness test and the one-rank real-rank path, in the time left.
  echo "== low-latency harness and real rank (-k 'cuda_harness or real_rank')"
  timeout -k 2 18 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_low_latency.py \
    tests/runtime/test_cuda_low_latency.py -k "cuda_harness or real_rank" \
    --junitxml="$WORK/s2_low_latency.xml"
  r=$?
  [ "$r" = 0 ] || [ "$r" = 5 ] || rc=1  # 5: no such test in this tree
  return $rc
}

stage_multiprocess() {
  local rc=0 r
  timeout -k 3 48 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime/test_mp_cuda.py \
    -k "not internode" --junitxml="$WORK/s3.xml" || rc=1
  # The low-latency mode with 2 and 4 processes sharing the GPU, in the time left.
  echo "== low-latency processes sharing the GPU (tests/runtime/test_cuda_low_latency_mp.py)"
  timeout -k 2 18 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/runtime/test_cuda_low_latency_mp.py --junitxml="$WORK/s3_low_latency.xml"
  r=$?
  [ "$r" = 0 ] || [ "$r" = 5 ] || rc=1  # 5: no such test in this tree
  return $rc
}

stage_internode() {
  if ! "$PY" -c "import jax_ep, sys; sys.exit(0 if jax_ep.build_info()['nvshmem'] else 3)"; then
    echo "skipped: this build has no NVSHMEM internode backend (build_info()['nvshmem'] is False)"
    echo "skipped (no NVSHMEM in this build)" >"$WORK/s4.status"
    return 0
  fi
  "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime/test_mp_cuda.py -k internode \
    --junitxml="$WORK/s4.xml"
}

stage_sanitizer() {
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "skipped: compute-sanitizer not found"
    echo "skipped (no compute-sanitizer)" >"$WORK/s5.status"
    return 0
  fi
  local worst=0 tool secs rc t0 status filter
  # Only jax_ep's kernels are instrumented (XLA's run unchecked), which keeps it fast.
  filter=(--kernel-name kns=jax_ep)
  # memcheck on every dtype width; the shared-memory checks on one dtype (same kernels).
  for spec in memcheck:22:float32,bfloat16 racecheck:18:float32 synccheck:14:float32; do
    IFS=: read -r tool secs dtypes <<<"$spec"
    t0=$(date +%s)
    echo "== compute-sanitizer --tool $tool (limit ${secs}s)"
    timeout -k 3 "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 ${filter[@]+"${filter[@]}"} \
      "$PY" scripts/gpu_sanitize_run.py --dtypes "$dtypes" 2>&1 | tee "$WORK/s5_$tool.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && grep -qiE "unrecognized|unknown option|invalid option" "$WORK/s5_$tool.txt"; then
      echo "(this compute-sanitizer has no --kernel-name filter: every kernel is checked)"
      filter=()
      timeout -k 3 "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$PY" scripts/gpu_sanitize_run.py --dtypes "$dtypes" 2>&1 | tee "$WORK/s5_$tool.txt"
      rc=${PIPESTATUS[0]}
    fi
    case "$rc" in
      0) status=clean ;;
      9) status="errors reported" ;;
      124|137) status="timed out" ;;
      *) status="failed (rc $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$tool" "$rc" "$(( $(date +%s) - t0 ))" "$status" >>"$WORK/s5.tools"
    [ "$rc" -ne 0 ] && worst=1
  done
  return $worst
}

stage_bench() {
  local rc=0
  echo "== python -m jax_ep.bench --virtual-ranks (8 ranks on this GPU through the harness)"
  timeout -k 2 26 "$PY" -m jax_ep.bench --virtual-ranks --ranks 8 --tokens 4096 --hidden 7168 \
    --topk 8 --experts 256 --dtype bfloat16 --repeats 3 --warmup 1 --input-sets 1 --no-progress \
    --json "$WORK/s6_bench.json" || rc=1
  echo "== python -m jax_ep.bench --mode low_latency --virtual-ranks (decode shape, bf16 + fp8)"
  timeout -k 2 16 "$PY" -m jax_ep.bench --mode low_latency --virtual-ranks --ranks 8 \
    --tokens 128 --hidden 7168 --topk 8 --experts 256 --repeats 5 --warmup 1 \
    --input-sets 1 --json "$WORK/s6_low_latency.json" || rc=1
  echo "== scripts/cuda_harness_bench.py (phase by phase, then concurrent streams)"
  timeout -k 2 16 "$PY" scripts/cuda_harness_bench.py --iters 10 --concurrent \
    --json "$WORK/s6_harness.json" || rc=1
  return $rc
}

export -f stage_build stage_tests stage_multiprocess stage_internode stage_sanitizer stage_bench

describe() {
  case "$1" in
    1) echo "$PY -m pip install --no-build-isolation --no-deps --no-index -e . (JAX_EP_CUDA=ON), then build_info()" ;;
    2) echo "$PY -m pytest -m gpu tests/runtime/test_cuda.py; tests/test_low_latency.py tests/runtime/test_cuda_low_latency.py -k 'cuda_harness or real_rank'" ;;
    3) echo "$PY -m pytest tests/runtime/test_mp_cuda.py -k 'not internode'; tests/runtime/test_cuda_low_latency_mp.py (CUDA MPS started if available)" ;;
    4) echo "$PY -m pytest tests/runtime/test_mp_cuda.py -k internode (skipped without NVSHMEM)" ;;
    5) echo "compute-sanitizer --tool memcheck|racecheck|synccheck $PY scripts/gpu_sanitize_run.py" ;;
    6) echo "$PY -m jax_ep.bench --virtual-ranks ...; $PY -m jax_ep.bench --mode low_latency --virtual-ranks ...; $PY scripts/cuda_harness_bench.py --concurrent" ;;
  esac
}

# ------------------------------------------------------------------------------ MPS
MPS_ON=0
mps_start() {
  [ "${JAX_EP_GPU_CHECK_MPS:-1}" = 1 ] || { echo "MPS: not started (JAX_EP_GPU_CHECK_MPS=0)"; return; }
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "MPS: nvidia-cuda-mps-control not found; processes time-slice the GPU"; return; }
  export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps_pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps_log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    MPS_ON=1
    echo "MPS: control daemon started"
  else
    echo "MPS: could not start the control daemon; processes time-slice the GPU"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}
mps_stop() {
  if [ "$MPS_ON" = 1 ]; then
    echo quit | nvidia-cuda-mps-control || true
    sleep 1
    MPS_ON=0
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap mps_stop EXIT

# ------------------------------------------------------------------------------ driver
start=$(date +%s)
BUILD_OK=1

record() {  # stage name status rc seconds budget
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$WORK/stages.tsv"
}

run_stage() {
  local n=$1 name=${NAMES[$(($1 - 1))]} budget=${BUDGETS[$(($1 - 1))]}
  local log="$OUT/s${n}_${name}.log"
  if [ "$DRY" = 1 ] && [ "$n" != 1 ]; then
    echo "== stage $n: $name -- budget ${budget}s -- would run: $(describe "$n")"
    record "$n" "$name" planned - 0 "$budget"
    return
  fi
  if [ "$n" != 1 ] && [ "$BUILD_OK" != 1 ]; then
    echo "== stage $n: $name -- not run (no working build)"
    record "$n" "$name" "not run (no build)" - 0 "$budget"
    return
  fi
  echo "== stage $n: $name (budget ${budget}s): $(describe "$n")"
  local t0 rc status
  t0=$(date +%s)
  timeout -k 5 "$budget" bash -c "stage_$name" >"$log" 2>&1
  rc=$?
  case "$rc" in
    0) status=pass ;;
    124|137) status="timeout (${budget}s)" ;;
    *) status="FAIL (rc $rc)" ;;
  esac
  if [ "$rc" = 0 ] && [ -s "$WORK/s$n.status" ]; then status=$(head -1 "$WORK/s$n.status"); fi
  [ "$n" = 1 ] && [ "$rc" != 0 ] && BUILD_OK=0
  tail -n 12 "$log" | sed 's/^/   | /'
  record "$n" "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$budget"
}

echo "== GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'none visible (nvidia-smi failed)')"

stages=(1 2 3 4 5 6)
if [ -n "$ONLY" ]; then
  stages=("$ONLY")
  if [ "$ONLY" != 1 ] && [ "$DRY" != 1 ] && \
     ! "$PY" -c "import jax_ep, sys; sys.exit(0 if jax_ep.build_info()['cuda'] else 1)" 2>/dev/null; then
    stages=(1 "$ONLY")  # no CUDA build yet on this machine
  fi
  [ "$DRY" = 1 ] && stages=(1 "$ONLY")
  [ "$ONLY" = 1 ] && stages=(1)
fi

for n in "${stages[@]}"; do
  [ "$n" = 3 ] && [ "$DRY" != 1 ] && [ "$BUILD_OK" = 1 ] && mps_start
  [ "$n" = 4 ] && [ "$DRY" != 1 ] && [ "$BUILD_OK" = 1 ] && { mps_stop; mps_start; }
  [ "$n" = 5 ] && mps_stop
  run_stage "$n"
done
mps_stop

total=0
for n in "${stages[@]}"; do total=$(( total + ${BUDGETS[$(($n - 1))]} )); done
echo
echo "time budget: stages $total s + overhead $OVERHEAD s = $(( total + OVERHEAD )) s" \
     "($(awk "BEGIN{printf \"%.1f\", ($total + $OVERHEAD) / 60}") min); limit $LIMIT s (9 min)"
echo "gpu_check: $(( $(date +%s) - start )) s elapsed; logs and gpu_check.json in $OUT"
echo
if ! "$PY" scripts/gpu_check_report.py "$WORK" "$OUT" 2>"$WORK/report.err"; then
  python3 scripts/gpu_check_report.py "$WORK" "$OUT" 2>>"$WORK/report.err" || {
    echo "(report script failed: $(tail -1 "$WORK/report.err")); raw stage records:"
    cat "$WORK/stages.tsv"; }
fi
# Exit status: 0 when every stage that ran passed or was skipped on purpose.
if awk -F'\t' '$3 ~ /^(FAIL|timeout|not run)/ {bad=1} END {exit bad ? 0 : 1}' "$WORK/stages.tsv"; then
  exit 1
fi
exit 0
