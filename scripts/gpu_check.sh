#!/usr/bin/env bash
# The GPU check of jax-ep, for one lent H100 or H200: builds the CUDA backend into the
# machine's own Python, runs the kernels every way one GPU allows, and prints a table
# last. Each stage is time-boxed and writes its log under $OUT; all stage results go to
# $OUT/gpu_check.json (with each stage's junit reports, the reason of every time-out and
# the MPS start status and logs: what a rerun needs) and the table to $OUT/summary.txt
# (8 files at most). A failing stage never stops the later ones (except a failed build).
# docs/gpu_check.md is the runbook: what each stage proves and what to do when it fails.
#
# A first GPU run has 15 minutes of device time in all, the machine's start (1-2 min) and
# a rerun included, so the whole check is two device calls of at most 720 s together,
# the most informative stages first (`--dry-run` prints the plan and its budget):
#   bash scripts/gpu_check.sh --only tests,internode,bench     # call 1: build + 2, 4, 6
#   bash scripts/gpu_check.sh --only multiprocess,sanitizer    # call 2: 3, 5 (build kept
#                                                              #  while the machine is warm)
#   bash scripts/gpu_check.sh --only 2                         # one stage (+ the build)
#   bash scripts/gpu_check.sh --dry-run                        # stage 1 for real, the plan
#   bash scripts/gpu_check.sh --emulated [--quick]             # rehearsal, no GPU needed
#
# --emulated runs the same stages, with the same pass/fail logic and report, against the
# emulated GPU (kernels/emu): the harness (2), virtual GPU groups in one process standing
# in for processes sharing a GPU over CUDA IPC (3: the emulator cannot share memory across
# processes), the internode modes over the emulated NVSHMEM (4), the path the sanitizer
# stage runs (5: without the tool) and the benchmarks' code paths (6, counted, not timed).
# --quick takes one short test per stage (what `make test` runs).
#
# Exit status: 0 every stage that ran passed; 1 a stage failed or timed out (or its build
# did); 3 none failed but a stage did not run (no NVSHMEM in the build, no
# compute-sanitizer): "not run", which is neither a failure nor green.
#
# Stages (budget in seconds; measured start-up plus margin, see BUDGETS below):
#   1 build       pip install --no-build-isolation --no-deps -e . with JAX_EP_CUDA=ON into
#                 $PYTHON (default python3: on the lent machine a virtualenv that already has
#                 jax, nanobind, scikit-build-core, NVSHMEM; no venv is made, nothing is
#                 downloaded); retried without NVSHMEM if that build fails; build_info()
#   2 tests       GPU tests: virtual-rank harness bit-exact vs the CPU oracle (dispatch,
#                 combine, gather, layout, every dtype, overflow, empty ranks), concurrent
#                 harness mode, call-site and timeout checks, reset(), real handlers
#   3 multiprocess  R = 2 and 4 processes on the GPU (CUDA IPC; MPS when available, each
#                 process given 100/R of the SMs by the test launcher):
#                 dispatch, combine, gradients bit-exact vs CPU; one process killed
#   4 internode   NVSHMEM PEs (2 and 4) on the GPU, bit-exact vs CPU (not run without
#                 NVSHMEM); under MPS with active thread percentages summing to 100, which
#                 NVSHMEM needs for full support of several PEs on one GPU; then the
#                 internode benchmarks, 4 PEs each: python -m jax_ep.bench --mode
#                 hierarchical (2 virtual nodes of 2), internode (direct) and
#                 internode_low_latency (jax_ep/bench/launch.py)
#   5 sanitizer   compute-sanitizer memcheck, racecheck, synccheck on a small harness run
#                 (short kernel timeout); the tool is looked for on PATH, in
#                 /usr/local/cuda/bin and /usr/local/cuda/compute-sanitizer
#   6 bench       python -m jax_ep.bench --virtual-ranks, and the harness timing
#
# Environment: OUT (default /tmp/jax_ep_gpu_check), PYTHON (default python3),
# JAX_EP_BUILD_LOCK (a lock file to hold while building, e.g. /tmp/jaxep.build.lock),
# JAX_EP_GPU_CHECK_MPS=0 (do not start CUDA MPS), JAX_EP_COMPUTE_SANITIZER (its path).
#
# Not part of this one-GPU check: the per-port proof needs two nodes with RDMA NICs. On
# each node, around the internode benchmark (docs/internode.md, "Proof on hardware"):
#   python -m jax_ep.network.fabric --gpu <GPU bus id>          # class, selected ports
#   python -m jax_ep.network.portcheck --gpu <GPU bus id> --tolerance 0.1 -- <benchmark>
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

DRY=0
EMU=0
QUICK=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --emulated) EMU=1 ;;
    --quick) QUICK=1 ;;
    --only) ONLY="${2:-}"; shift ;;
    --only=*) ONLY="${1#*=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'"; usage; exit 2 ;;
  esac
  shift
done
if [ "$QUICK" = 1 ] && [ "$EMU" != 1 ]; then
  echo "gpu_check: --quick is for --emulated (a GPU run takes every test of a stage)"; exit 2
fi

NAMES=(build tests multiprocess internode sanitizer bench)
# Time boxes: the start-up of the stage's processes plus their work, measured on CPU runs
# of the same tests (their CPU variants, same workers and launcher), with margin. Measured
# on a 2-core machine at load average 2.5 to 6 (2026-12-07):
#   test_mp_cuda.py::test_worker_and_oracle_on_cpu (2 processes)            15 s
#   test_cuda_low_latency_mp.py::test_worker_and_oracle_on_cpu_processes    37 s
# The lent machine has 16 cores, so R processes start in parallel; a CUDA context and the
# GPU compiles add a few seconds per process, covered by the margin (about 2x).
# The build: its longest compile is hierarchical_kernels.cu, 34 s on those 2 cores (ninja's
# log), the rest run beside it on 16 cores; 140 s holds pip's own start and the link.
# Stage 3 runs three tests of the first kind (2 and 4 processes, one killed: it waits
# JAX_EP_TIMEOUT_S) and two of the second (2 and 4 processes); stage 4 three of the first.
MP_BOX=80       # stage 3: tests/runtime/test_mp_cuda.py -k "not internode"
LL_MP_BOX=90    # stage 3: tests/runtime/test_cuda_low_latency_mp.py
IN_BOX=90       # stage 4: tests/runtime/test_mp_cuda.py -k internode
IN_BENCH_BOX=90  # stage 4: python -m jax_ep.bench --mode ... (4 PEs), three launches
BUDGETS=(140 70 $((MP_BOX + LL_MP_BOX + 10)) $((IN_BOX + IN_BENCH_BOX + 10)) 50 45)
OVERHEAD=20     # per device call: GPU query, MPS start/stop, the report
LIMIT=540       # 9 minutes: one device call must end well inside its 10
TOTAL_LIMIT=720 # the whole check: 15 minutes less the machine's start and a rerun
# The two device calls of a first GPU run, most informative first: the kernels against
# the oracle (2), the internode transport no other run exercises (4), the numbers (6);
# then processes sharing the GPU (3) and the sanitizer (5).
CALLS=("tests,internode,bench" "multiprocess,sanitizer")
# The emulated rehearsal's boxes (2 cores, the whole matrix's tests of each stage; --quick
# one each).
EMU_BUDGETS=(120 600 600 900 300 600)

# stage_numbers LIST: "2,internode,6" -> "2 4 6" (exit 2 on an unknown name)
stage_numbers() {
  local item i out=() found
  IFS=, read -ra items <<<"$1"
  for item in "${items[@]}"; do
    found=""
    for i in "${!NAMES[@]}"; do
      if [ "$item" = "${NAMES[$i]}" ] || [ "$item" = "$((i + 1))" ]; then found=$((i + 1)); fi
    done
    [ -n "$found" ] || return 2
    out+=("$found")
  done
  printf '%s\n' "${out[@]}" | sort -n | uniq | tr '\n' ' '
}

ONLY_STAGES=()
if [ -n "$ONLY" ]; then
  if ! list=$(stage_numbers "$ONLY"); then
    echo "gpu_check: --only takes 1-6 or one of: ${NAMES[*]} (a comma-separated list)"; exit 2
  fi
  read -ra ONLY_STAGES <<<"$list"
fi
if [ "$EMU" = 1 ]; then BUDGETS=("${EMU_BUDGETS[@]}"); fi

export OUT="${OUT:-/tmp/jax_ep_gpu_check}"
# Scratch outside $OUT: only logs, the JSON and the table come back from the machine.
export WORK="${JAX_EP_GPU_CHECK_WORK:-/tmp/jax_ep_gpu_check_work}"
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK"
# On the lent GPU machine python3 is the virtualenv to build into; the emulated rehearsal
# runs where `make test` built, the repository's .venv when there is one.
if [ "$EMU" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
  PYTHON="$ROOT/.venv/bin/python"
fi
export PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Several processes share the GPU and the harness allocates outside XLA's pool.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The virtual-rank harness needs a hardware queue per rank (its kernels wait across ranks,
# and ranks sharing a queue deadlock); the driver reads this once, when CUDA initialises.
# The emulated GPU reads it too (its queues), so the rehearsal runs the same way.
export CUDA_DEVICE_MAX_CONNECTIONS=32
# A short kernel timeout on the GPU, so a missing peer ends inside the boxes (the emulated
# GPU runs on virtual time and its tests set their own).
[ "$EMU" = 1 ] || export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
# The CPU oracle in the tests runs on virtual CPU devices.
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

# ------------------------------------------------------------------------------ stages
# Each runs in its own bash under `timeout`; it may write WORK/sN.status (a status that
# replaces "pass", e.g. a skip), WORK/sN*.json, WORK/sN*.xml (junit), WORK/sN.tools or
# WORK/sN.timeouts (one line per inner time box that ran out).

# boxed SECONDS WHAT CMD...: CMD under an inner time box; a box that runs out is recorded
# with WHAT in WORK/s$STAGE.timeouts (the report names it).
boxed() {
  local secs=$1 what=$2 rc
  shift 2
  timeout -k 3 "$secs" "$@"
  rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    printf '%s\t%s\n' "$what" "inner box of ${secs}s ran out" >>"$WORK/s${STAGE}.timeouts"
  fi
  return $rc
}

# The compute-sanitizer binary: JAX_EP_COMPUTE_SANITIZER if set (a path; tests set a
# missing one), else on PATH, or where CUDA toolkits put it.
find_sanitizer() {
  local c
  if [ -n "${JAX_EP_COMPUTE_SANITIZER:-}" ]; then
    [ -f "$JAX_EP_COMPUTE_SANITIZER" ] && [ -x "$JAX_EP_COMPUTE_SANITIZER" ] && \
      { echo "$JAX_EP_COMPUTE_SANITIZER"; return 0; }
    return 1
  fi
  for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           "$(dirname "$(command -v nvcc 2>/dev/null || echo /none/nvcc)")/compute-sanitizer"; do
    if [ -n "$c" ] && [ -f "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

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
    from jax_ep._src.backends import internode
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
  boxed 64 "tests/runtime/test_cuda.py" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/runtime/test_cuda.py --junitxml="$WORK/s2.xml" || rc=1
  # The low-latency kernels' harness test and the one-rank real-rank path, in the time left.
  echo "== low-latency harness and real rank (-k 'cuda_harness or real_rank')"
  boxed 18 "low-latency harness and real rank" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_low_latency.py tests/runtime/test_cuda_low_latency.py \
    -k "cuda_harness or real_rank" --junitxml="$WORK/s2_low_latency.xml"
  r=$?
  [ "$r" = 0 ] || [ "$r" = 5 ] || rc=1  # 5: no such test in this tree
  return $rc
}

stage_multiprocess() {
  local rc=0 r
  # The launcher gives each of the R processes CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R
  # (tests/runtime/mp_cuda_worker.py mps_env), so kernels that wait for each other all
  # stay resident under MPS.
  boxed "$MP_BOX" "tests/runtime/test_mp_cuda.py -k 'not internode'" "$PY" -m pytest -q -rs \
    -p no:cacheprovider -m gpu tests/runtime/test_mp_cuda.py -k "not internode" \
    --junitxml="$WORK/s3.xml" || rc=1
  echo "== low-latency processes sharing the GPU (tests/runtime/test_cuda_low_latency_mp.py)"
  boxed "$LL_MP_BOX" "tests/runtime/test_cuda_low_latency_mp.py" "$PY" -m pytest -q -rs \
    -p no:cacheprovider -m gpu tests/runtime/test_cuda_low_latency_mp.py \
    --junitxml="$WORK/s3_low_latency.xml"
  r=$?
  [ "$r" = 0 ] || [ "$r" = 5 ] || rc=1  # 5: no such test in this tree
  return $rc
}

stage_internode() {
  if ! "$PY" -c "import jax_ep, sys; sys.exit(0 if jax_ep.build_info()['nvshmem'] else 3)"; then
    echo "not run: this build has no NVSHMEM internode backend (build_info()['nvshmem'] is False)"
    echo "not run (no NVSHMEM in this build)" >"$WORK/s4.status"
    return 0
  fi
  if [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo "note: MPS is not running: NVSHMEM gives several PEs on one GPU only limited support"
  fi
  # Several PEs on one GPU: NCCL cannot run there (NVSHMEM says so and turns it off).
  export NVSHMEM_DISABLE_NCCL=1
  # The inner box ends before the stage's, so its junit report and reason still come back.
  local rc=0 mode secs
  boxed "$IN_BOX" "tests/runtime/test_mp_cuda.py -k internode" "$PY" -m pytest -q -rs \
    -p no:cacheprovider -m gpu tests/runtime/test_mp_cuda.py -k internode \
    --junitxml="$WORK/s4.xml" || rc=1
  # The internode benchmarks: one process (PE) per rank on this GPU; each launch's own
  # deadline ends before its box, so the launcher still names the processes it killed.
  for spec in hierarchical:35 internode:25 internode_low_latency:25; do
    IFS=: read -r mode secs <<<"$spec"
    echo "== python -m jax_ep.bench --mode $mode --processes 4 (limit ${secs}s)"
    if [ "$mode" = internode_low_latency ]; then
      boxed "$secs" "jax_ep.bench --mode $mode" "$PY" -m jax_ep.bench --mode "$mode" \
        --processes 4 --ranks 4 --tokens 128 --hidden 7168 --topk 8 --experts 32 \
        --repeats 5 --warmup 1 --input-sets 1 --memcpy-mib 64 \
        --launch-timeout $((secs - 5)) --json "$WORK/s4_bench_$mode.json" || rc=1
    else
      boxed "$secs" "jax_ep.bench --mode $mode" "$PY" -m jax_ep.bench --mode "$mode" \
        --processes 4 --ranks 4 --gpus-per-node 2 --tokens 1024 --hidden 7168 --topk 4 \
        --experts 32 --dtype bfloat16 --ops dispatch,combine --repeats 3 --warmup 1 \
        --input-sets 1 --memcpy-mib 64 --launch-timeout $((secs - 5)) \
        --json "$WORK/s4_bench_$mode.json" || rc=1
    fi
  done
  return $rc
}

stage_sanitizer() {
  local cs
  if ! cs=$(find_sanitizer); then
    echo "not run: compute-sanitizer not found (PATH, /usr/local/cuda/bin, /usr/local/cuda/compute-sanitizer)"
    echo "not run (no compute-sanitizer)" >"$WORK/s5.status"
    return 0
  fi
  echo "compute-sanitizer: $cs"
  # One virtual rank (the tool serialises kernels, and two ranks' channel kernels wait on
  # each other: see scripts/gpu_sanitize_run.py), and a short kernel timeout so a wait
  # that does hang ends inside the box.
  export JAX_EP_TIMEOUT_S=5
  local worst=0 tool secs rc t0 status filter
  # Only jax_ep's kernels are instrumented (XLA's run unchecked), which keeps it fast.
  filter=(--kernel-name kns=jax_ep)
  # memcheck on every dtype width; the shared-memory checks on one dtype (same kernels).
  for spec in memcheck:18:float32,bfloat16 racecheck:14:float32 synccheck:12:float32; do
    IFS=: read -r tool secs dtypes <<<"$spec"
    t0=$(date +%s)
    echo "== compute-sanitizer --tool $tool (limit ${secs}s)"
    timeout -k 3 "$secs" "$cs" --tool "$tool" --error-exitcode 9 ${filter[@]+"${filter[@]}"} \
      "$PY" scripts/gpu_sanitize_run.py --ranks 1 --dtypes "$dtypes" 2>&1 | tee "$WORK/s5_$tool.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ] && grep -qiE "unrecognized|unknown option|invalid option" "$WORK/s5_$tool.txt"; then
      echo "(this compute-sanitizer has no --kernel-name filter: every kernel is checked)"
      filter=()
      timeout -k 3 "$secs" "$cs" --tool "$tool" --error-exitcode 9 \
        "$PY" scripts/gpu_sanitize_run.py --ranks 1 --dtypes "$dtypes" 2>&1 | tee "$WORK/s5_$tool.txt"
      rc=${PIPESTATUS[0]}
    fi
    case "$rc" in
      0) status=clean ;;
      9) status="errors reported" ;;
      124|137) status="timed out" ;;
      *) status="failed (rc $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$tool" "$rc" "$(( $(date +%s) - t0 ))" "$status" >>"$WORK/s5.tools"
    case "$rc" in 124|137) printf '%s\t%s\n' "compute-sanitizer --tool $tool" \
      "inner box of ${secs}s ran out" >>"$WORK/s5.timeouts" ;; esac
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

# ---------------------------------------------------------------- emulated stages
# The same stages against the emulated GPU (--emulated): the CUDA kernel sources and the
# CUDA handlers' bodies on virtual GPUs (docs/emulator.md). --quick: one test per stage.
# The inner box of stage $STAGE: its budget less 5 s, so the junit report and the reason
# come back before the stage's own box ends.
inner_box() {
  local b
  read -ra b <<<"$BUDGETS_LIST"
  echo $(( ${b[$((STAGE - 1))]} - 5 ))
}
emu_pytest() {  # emu_pytest JUNIT_NAME WHAT PYTEST_ARGS...
  local junit=$1 what=$2
  shift 2
  local sel=()
  [ "$QUICK" = 1 ] && sel=(--maxfail=1)
  boxed "$(inner_box)" "$what" "$PY" -m pytest -q -rs -p no:cacheprovider \
    ${sel[@]+"${sel[@]}"} --junitxml="$WORK/$junit.xml" "$@"
}
stage_build_emu() {
  "$PY" - "$WORK/s1.json" <<'EOF2'
import json, sys
import jax, jax_ep
from jax_ep._src import emu
mod = emu.module()
res = {"build_info": jax_ep.build_info(), "jax": jax.__version__,
       "python": sys.version.split()[0], "emulated": True, "emu_module": mod.__file__}
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
print("build_info:", json.dumps(res["build_info"]))
print("emulated GPU module:", mod.__file__)
EOF2
}
stage_tests_emu() {
  # The virtual-rank harness: every rank's kernels on its own stream, streams on the
  # emulated GPU's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS).
  if [ "$QUICK" = 1 ]; then
    emu_pytest s2 "tests/emu/test_harness_emu.py (quick)" tests/emu/test_harness_emu.py \
      -k "ranks_sharing_a_queue_with_xla_stream or more_ranks_than_queues"
  else
    emu_pytest s2 "tests/emu/test_harness_emu.py" tests/emu/test_harness_emu.py
  fi
}
stage_multiprocess_emu() {
  # Stands in for processes sharing a GPU over CUDA IPC: the real-rank handlers on R
  # virtual GPUs in one process, each with its own group buffers mapped by its peers,
  # and a rank that never arrives (the killed process).
  local k="test_dispatch_combine_gather or rank_that_skips_a_call"
  [ "$QUICK" = 1 ] && k="rank_that_skips_a_call_ends"
  emu_pytest s3 "tests/emu/test_intranode_emu.py -k '$k'" tests/emu/test_intranode_emu.py \
    -k "$k and not full"
}
stage_internode_emu() {
  if [ "$QUICK" = 1 ]; then
    emu_pytest s4 "internode (quick)" tests/emu/test_internode_emu.py \
      -k "test_direct_matches_reference"
  else
    emu_pytest s4 "tests/emu/test_internode*_emu.py" tests/emu/test_internode_emu.py \
      tests/emu/test_internode_hier_emu.py tests/emu/test_internode_ll_emu.py
  fi
}
stage_sanitizer_emu() {
  # The code path the sanitizer stage runs (a serialised tool: each kernel alone), without
  # the tool: the same script, on the emulated GPU.
  boxed "$(inner_box)" "gpu_sanitize_run.py (emulated)" "$PY" scripts/gpu_sanitize_run.py \
    --emulated --dtypes float32
}
stage_bench_emu() {
  # The benchmarks' code paths: counted by the emulator, never timed.
  local modes=intranode,intranode_ll,direct,hierarchical,internode_ll
  [ "$QUICK" = 1 ] && modes=intranode
  boxed "$(inner_box)" "jax_ep.bench --emulated" "$PY" -m jax_ep.bench --emulated \
    --modes "$modes" --json "$WORK/s6_emulated.json"
}

export -f boxed find_sanitizer stage_build stage_tests stage_multiprocess stage_internode \
  stage_sanitizer stage_bench inner_box emu_pytest stage_build_emu stage_tests_emu stage_multiprocess_emu \
  stage_internode_emu stage_sanitizer_emu stage_bench_emu
export MP_BOX LL_MP_BOX IN_BOX IN_BENCH_BOX QUICK
export BUDGETS_LIST="${BUDGETS[*]}"

describe() {
  if [ "$EMU" = 1 ]; then
    case "$1" in
      1) echo "the emulated GPU module (jax_ep._src.emu.module()) and build_info()" ;;
      2) echo "$PY -m pytest tests/emu/test_harness_emu.py (the harness on the emulated GPU)" ;;
      3) echo "$PY -m pytest tests/emu/test_intranode_emu.py (virtual GPU groups in one process, for processes over IPC)" ;;
      4) echo "$PY -m pytest tests/emu/test_internode*_emu.py (emulated NVSHMEM)" ;;
      5) echo "$PY scripts/gpu_sanitize_run.py --emulated (the sanitizer stage's path, without the tool)" ;;
      6) echo "$PY -m jax_ep.bench --emulated (counted, not timed)" ;;
    esac
    return
  fi
  case "$1" in
    1) echo "$PY -m pip install --no-build-isolation --no-deps --no-index -e . (JAX_EP_CUDA=ON), then build_info()" ;;
    2) echo "$PY -m pytest -m gpu tests/runtime/test_cuda.py; tests/test_low_latency.py tests/runtime/test_cuda_low_latency.py -k 'cuda_harness or real_rank'" ;;
    3) echo "$PY -m pytest tests/runtime/test_mp_cuda.py -k 'not internode'; tests/runtime/test_cuda_low_latency_mp.py (CUDA MPS started if available)" ;;
    4) echo "$PY -m pytest tests/runtime/test_mp_cuda.py -k internode; $PY -m jax_ep.bench --mode hierarchical|internode|internode_low_latency --processes 4 ... (not run without NVSHMEM)" ;;
    5) echo "compute-sanitizer --tool memcheck|racecheck|synccheck $PY scripts/gpu_sanitize_run.py --ranks 1 (found at: $(find_sanitizer || echo 'not found: the stage would not run'))" ;;
    6) echo "$PY -m jax_ep.bench --virtual-ranks ...; $PY -m jax_ep.bench --mode low_latency --virtual-ranks ...; $PY scripts/cuda_harness_bench.py --concurrent" ;;
  esac
}

# ------------------------------------------------------------------------------ MPS
MPS_ON=0
# What happened is kept in WORK/mps.status (and the daemon's logs in WORK/mps_log): the
# report puts both into gpu_check.json.
mps_say() { echo "${*:2}"; printf 'stage %s: %s\n' "$1" "${*:2}" >>"$WORK/mps.status"; }
mps_start() {
  local n=$1
  [ "${JAX_EP_GPU_CHECK_MPS:-1}" = 1 ] || { mps_say "$n" "MPS: not started (JAX_EP_GPU_CHECK_MPS=0)"; return; }
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { mps_say "$n" "MPS: nvidia-cuda-mps-control not found; processes time-slice the GPU"; return; }
  export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps_pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps_log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$WORK/mps.status" 2>&1; then
    MPS_ON=1
    mps_say "$n" "MPS: control daemon started"
  else
    mps_say "$n" "MPS: could not start the control daemon (rc $?); processes time-slice the GPU"
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
  local fn="stage_$name"
  [ "$EMU" = 1 ] && fn="stage_${name}_emu"
  STAGE=$n timeout -k 5 "$budget" bash -c "$fn" >"$log" 2>&1
  rc=$?
  case "$rc" in
    0) status=pass ;;
    124|137) status="timeout (${budget}s)"
      printf '%s\t%s\n' "stage $n ($name)" \
        "stage box of ${budget}s ran out; last output: $(tail -n 1 "$log" | cut -c1-200)" \
        >>"$WORK/s$n.timeouts" ;;
    *) status="FAIL (rc $rc)" ;;
  esac
  if [ "$rc" = 0 ] && [ -s "$WORK/s$n.status" ]; then status=$(head -1 "$WORK/s$n.status"); fi
  [ "$n" = 1 ] && [ "$rc" != 0 ] && BUILD_OK=0
  tail -n 12 "$log" | sed 's/^/   | /'
  record "$n" "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$budget"
}

if [ "$EMU" = 1 ]; then
  echo "== GPU: emulated (kernels/emu: the CUDA kernel sources on virtual GPUs on the CPU)"
else
  echo "== GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'none visible (nvidia-smi failed)')"
fi

have_build() {
  if [ "$EMU" = 1 ]; then
    "$PY" -c "from jax_ep._src import emu; emu.module()" 2>/dev/null
  else
    "$PY" -c "import jax_ep, sys; sys.exit(0 if jax_ep.build_info()['cuda'] else 1)" 2>/dev/null
  fi
}

stages=(1 2 3 4 5 6)
if [ ${#ONLY_STAGES[@]} -gt 0 ]; then
  stages=("${ONLY_STAGES[@]}")
  if [ "${stages[0]}" != 1 ] && { [ "$DRY" = 1 ] || ! have_build; }; then
    stages=(1 "${stages[@]}")  # no build yet on this machine (a dry run always builds)
  fi
fi

for n in "${stages[@]}"; do
  if [ "$EMU" != 1 ]; then
    [ "$n" = 3 ] && [ "$DRY" != 1 ] && [ "$BUILD_OK" = 1 ] && mps_start 3
    [ "$n" = 4 ] && [ "$DRY" != 1 ] && [ "$BUILD_OK" = 1 ] && { mps_stop; mps_start 4; }
    [ "$n" = 5 ] && mps_stop
  fi
  run_stage "$n"
done
mps_stop

# budget_of "2 4 6": the stages' budgets plus one call's overhead
budget_of() {
  local t=$OVERHEAD n
  for n in $1; do t=$(( t + ${BUDGETS[$(($n - 1))]} )); done
  echo "$t"
}
total=$(budget_of "${stages[*]}")
echo
if [ "$EMU" = 1 ]; then
  echo "time boxes (emulated GPU, on this machine's cores): $(( total - OVERHEAD )) s"
else
  echo "time budget: stages $(( total - OVERHEAD )) s + overhead $OVERHEAD s = $total s" \
       "($(awk "BEGIN{printf \"%.1f\", $total / 60}") min); limit $LIMIT s (9 min) per call"
fi
if [ "$DRY" = 1 ] && [ "$EMU" != 1 ]; then
  # The plan of a first GPU run: the build in the first call, kept by the warm machine
  # for the second (a cold second call rebuilds: the margin in TOTAL_LIMIT's 15 minutes).
  whole=0 i=0
  for call in "${CALLS[@]}"; do
    i=$((i + 1))
    nums=$(stage_numbers "$call")
    [ "$i" = 1 ] && nums="1 $nums"
    t=$(budget_of "$nums")
    whole=$(( whole + t ))
    echo "device call $i: bash scripts/gpu_check.sh --only $call -- stages ${nums% }, budget $t s"
    [ "$t" -le "$LIMIT" ] || echo "gpu_check: device call $i exceeds $LIMIT s"
  done
  echo "first GPU run: ${#CALLS[@]} device calls, budget $whole s of $TOTAL_LIMIT s"
  [ "$whole" -le "$TOTAL_LIMIT" ] || echo "gpu_check: the plan exceeds $TOTAL_LIMIT s"
fi
echo "gpu_check: $(( $(date +%s) - start )) s elapsed; logs and gpu_check.json in $OUT"
echo
if ! "$PY" scripts/gpu_check_report.py "$WORK" "$OUT" 2>"$WORK/report.err"; then
  python3 scripts/gpu_check_report.py "$WORK" "$OUT" 2>>"$WORK/report.err" || {
    echo "(report script failed: $(tail -1 "$WORK/report.err")); raw stage records:"
    cat "$WORK/stages.tsv"; }
fi
# Exit status (see the top): 1 failed, 3 not run (not verified), 0 every stage passed.
if awk -F'\t' '$3 ~ /^(FAIL|timeout)/ {bad=1} END {exit bad ? 0 : 1}' "$WORK/stages.tsv"; then
  exit 1
fi
if awk -F'\t' '$3 ~ /^not run/ {s=1} END {exit s ? 0 : 1}' "$WORK/stages.tsv"; then
  echo "gpu_check: not green: a stage did not run (exit 3)"
  exit 3
fi
exit 0
