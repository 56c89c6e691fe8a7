"""scripts/gpu_check.sh --dry-run works on a machine without a GPU or a network, as the
lent GPU machine's first call needs it to: stage 1 (the CUDA build into the given Python,
pip's index switched off) really runs, every later stage is planned within a budget
under 9 minutes, and what comes back fits the device tool's 8 files."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
LOCK = "/tmp/jaxep.build.lock"  # the project's build lock (other builds hold it too)


def _nvcc() -> bool:
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(PYTHON=sys.executable, PIP_NO_INDEX="1", JAX_EP_BUILD_LOCK=LOCK,
               OUT=str(tmp_path / "out"), JAX_EP_GPU_CHECK_WORK=str(tmp_path / "work"),
               CUDA_VISIBLE_DEVICES="")
    return env


def _wait_for_lock(seconds: float) -> bool:
    """Whether the build lock came free within `seconds` (then the script takes it)."""
    deadline = time.monotonic() + seconds
    with open(LOCK, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(2)


@pytest.mark.slow
@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed: the dry run builds the CUDA backend")
def test_dry_run_builds_and_plans_the_first_gpu_run(tmp_path):
    if not _wait_for_lock(180):
        pytest.skip(f"{LOCK} stayed held by another build for 3 minutes")
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=900)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-6000:]
    # Stage 1 really built: pip ran and the fresh extension reports the CUDA backend.
    log = (tmp_path / "out" / "s1_build.log").read_text()
    assert "--no-index" in text and re.search(r"Successfully installed jax-ep", log), log[-3000:]
    info = json.loads(re.search(r"^build_info: (\{.*\})$", log, re.M).group(1))
    assert info["cuda"] is True and "sm_90" in info["cuda_archs"], info
    # A first GPU run: two device calls, each under 9 minutes, together at most 720 s
    # (15 minutes less the machine's start and a rerun).
    m = re.search(r"time budget: stages (\d+) s \+ overhead (\d+) s = (\d+) s", text)
    assert m, text[-3000:]
    assert int(m.group(1)) + int(m.group(2)) == int(m.group(3))
    calls = re.findall(r"^device call (\d): bash scripts/gpu_check.sh --only (\S+) -- stages "
                       r"([\d ]+), budget (\d+) s$", text, re.M)
    assert [c[0] for c in calls] == ["1", "2"], text[-3000:]
    planned = sorted(int(n) for c in calls for n in c[2].split())
    assert planned == [1, 2, 3, 4, 5, 6], calls
    assert all(int(c[3]) <= 540 for c in calls), calls
    whole = re.search(r"^first GPU run: 2 device calls, budget (\d+) s of 720 s$", text, re.M)
    assert whole and int(whole.group(1)) == sum(int(c[3]) for c in calls) <= 720, text[-2000:]
    assert "exceeds" not in text
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in res["stages"]}
    assert sorted(stages) == [1, 2, 3, 4, 5, 6]
    assert stages[1]["status"] == "pass" and stages[1]["seconds"] <= stages[1]["budget"]
    assert stages[1]["results"]["s1"]["build_info"]["cuda"] is True
    for n in range(2, 7):
        assert stages[n]["status"] == "planned" and stages[n]["budget"] > 0, stages[n]
        assert f"== stage {n}: {stages[n]['name']} -- budget" in text
    assert sum(s["budget"] for s in stages.values()) == int(m.group(1))
    # What comes back from the device machine: at most 8 files, none deeper than allowed.
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs]
    assert 0 < len(files) <= 8, files
    # The table comes last.
    assert text.rstrip().splitlines()[-1].startswith("6 ")


def test_only_rejects_an_unknown_stage(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "--only", "everything"], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "--only takes 1-6 or one of: build tests multiprocess internode sanitizer bench" \
        in p.stdout
    p = subprocess.run(["bash", SCRIPT, "--only", "tests,everything"], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--only takes" in p.stdout
    p = subprocess.run(["bash", SCRIPT, "--quick"], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--quick is for --emulated" in p.stdout


def _plan():
    """The stage budgets, the per-call overhead, the limits and the two device calls, as
    bash evaluates them, with the script's own stage_numbers and budget_of."""
    text = open(SCRIPT).read()
    names = re.search(r"^NAMES=\(.*?\)$", text, re.M).group(0)
    block = re.search(r"^MP_BOX=.*?^EMU_BUDGETS=\(.*?\)$", text, re.M | re.S).group(0)
    fns = re.search(r"^stage_numbers\(\) \{.*?^\}$", text, re.M | re.S).group(0)
    bud = re.search(r"^budget_of\(\) \{.*?^\}$", text, re.M | re.S).group(0)
    script = "\n".join([names, block, fns, bud, 'for c in "${CALLS[@]}"; do n=$(stage_numbers '
                        '"$c"); echo "$c|$n|$(budget_of "$n")"; done',
                        'echo "$(budget_of 1)|$LIMIT|$TOTAL_LIMIT|$OVERHEAD"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    calls = [(c, [int(x) for x in n.split()], int(b)) for c, n, b in
             (ln.split("|") for ln in out[:-1])]
    build, limit, total_limit, overhead = map(int, out[-1].split("|"))
    return calls, build - overhead, limit, total_limit, overhead


def test_first_gpu_run_fits_fifteen_minutes():
    """Two device calls hold every stage, the build in the first (kept by the warm machine
    for the second), each call under 9 minutes and both together at most 720 s: the 15
    minutes of a first GPU run less the machine's start (1-2 min) and a rerun."""
    calls, build, limit, total_limit, _ = _plan()
    assert len(calls) == 2
    assert sorted(n for _, ns, _ in calls for n in ns) == [2, 3, 4, 5, 6]
    first = calls[0][2] + build
    assert first <= limit and all(b <= limit for _, _, b in calls[1:])
    assert total_limit == 720 and first + sum(b for _, _, b in calls[1:]) <= total_limit
    # the most informative first: the kernels against the oracle, then the internode
    # transport no other run exercises
    assert calls[0][1][:2] == [2, 4]
    # any one stage alone with the build fits one call
    _, budgets = _budgets()
    assert all(budgets[0] + b + 20 <= limit for b in budgets[1:])



def _budgets():
    """The script's inner boxes and stage budgets, as bash evaluates them."""
    text = open(SCRIPT).read()
    block = re.search(r"^MP_BOX=.*?^BUDGETS=\(.*?\)$", text, re.M | re.S).group(0)
    out = subprocess.run(["bash", "-c", block + '\necho "$MP_BOX $LL_MP_BOX $IN_BOX '
                          '$IN_BENCH_BOX"\necho "${BUDGETS[@]}"'], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    box = dict(zip(("MP_BOX", "LL_MP_BOX", "IN_BOX", "IN_BENCH_BOX"),
                   map(int, out[0].split())))
    return box, [int(v) for v in out[1].split()]


def test_time_boxes_fit_their_stage_and_the_measured_runs():
    box, budgets = _budgets()
    # inner boxes end before their stage's box, so the junit report and reason come back
    assert budgets[2] > box["MP_BOX"] + box["LL_MP_BOX"]
    assert budgets[3] > box["IN_BOX"] + box["IN_BENCH_BOX"]
    # the internode benchmarks' own boxes fit theirs, each launch's deadline inside its box
    text = open(SCRIPT).read()
    stage = text[text.index("stage_internode() {"):]
    stage = stage[:stage.index("\n}\n")]
    specs = re.search(r"for spec in (.*?); do", stage).group(1).split()
    secs = {m: int(t) for m, t in (sp.split(":") for sp in specs)}
    assert set(secs) == {"hierarchical", "internode", "internode_low_latency"}
    assert sum(secs.values()) <= box["IN_BENCH_BOX"]
    assert stage.count("--launch-timeout $((secs - 5))") == 2
    assert stage.count('--json "$WORK/s4_bench_$mode.json"') == 2
    # no shorter than the CPU runs of the same tests measured for them (the script's
    # comment) plus margin: 15 s per 2-process run of the first kind (three runs in stage
    # 3 and in stage 4, one of them waiting out a 5 s kernel timeout), 37 s for the
    # 2-process low-latency run (two runs, the second of 4 processes)
    text = open(SCRIPT).read()
    assert re.search(r"test_worker_and_oracle_on_cpu \(2 processes\)\s+15 s", text)
    assert re.search(r"test_worker_and_oracle_on_cpu_processes\s+37 s", text)
    assert box["MP_BOX"] >= 3 * 15 + 5 and box["IN_BOX"] >= 3 * 15
    assert box["LL_MP_BOX"] >= 2 * 37


def test_mps_share_per_process():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mp_cuda_worker import mps_env
    assert mps_env({}, 4)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert mps_env({}, 3)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"  # sums to <= 100
    kept = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}
    assert mps_env(kept, 2)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"


def _built_with_cuda() -> bool:
    r = subprocess.run([sys.executable, "-c", "import jax_ep, sys; "
                        "sys.exit(0 if jax_ep.build_info()['cuda'] else 1)"],
                       capture_output=True, timeout=120)
    return r.returncode == 0


def test_a_stage_that_did_not_run_is_not_green(tmp_path):
    """--only sanitizer where no compute-sanitizer is found: reported as not run (neither
    a failure nor green), the overall verdict says so and the exit status is 3."""
    if not _built_with_cuda():
        pytest.skip("no CUDA build here: --only would build first")
    env = _env(tmp_path)
    env["JAX_EP_COMPUTE_SANITIZER"] = str(tmp_path / "no-such-sanitizer")
    p = subprocess.run(["bash", SCRIPT, "--only", "sanitizer"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    text = p.stdout + p.stderr
    assert p.returncode == 3, text[-4000:]
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [s["stage"] for s in res["stages"]] == [5]
    assert res["stages"][0]["status"] == "not run (no compute-sanitizer)"
    assert res["overall"].startswith("not verified") and "sanitizer" in res["overall"]
    assert "overall: not verified" in (tmp_path / "out" / "summary.txt").read_text()
    assert "not found (PATH, /usr/local/cuda/bin, /usr/local/cuda/compute-sanitizer)" in \
        (tmp_path / "out" / "s5_sanitizer.log").read_text()


def test_report_keeps_what_a_rerun_needs(tmp_path):
    """junit reports, time-out reasons and the MPS status go into gpu_check.json."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "mps_log").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("3\tmultiprocess\ttimeout (325s)\t124\t325\t325\n"
                                     "4\tinternode\tpass\t0\t80\t165\n")
    (work / "s3.timeouts").write_text(
        "tests/runtime/test_mp_cuda.py -k 'not internode'\tinner box of 140s ran out\n")
    (work / "s3.xml").write_text(
        '<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0">'
        '<testcase classname="t" name="test_a"/><testcase classname="t" name="test_b">'
        '<failure message="boom"/></testcase></testsuite></testsuites>')
    (work / "mps.status").write_text("stage 3: MPS: control daemon started\n")
    (work / "mps_log" / "control.log").write_text("[INFO] Starting control daemon\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check_report.py"),
                        str(work), str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["overall"] == "FAIL"
    s3 = res["stages"][0]
    assert s3["results"]["timeouts"][0]["reason"] == "inner box of 140s ran out"
    assert "<failure message=\"boom\"/>" in s3["results"]["s3_junit_xml"]
    assert s3["detail"].startswith("TIMED OUT tests/runtime/test_mp_cuda.py")
    assert "first failure: test_b" in s3["detail"]
    assert res["mps"]["status"] == ["stage 3: MPS: control daemon started"]
    assert "Starting control daemon" in res["mps"]["control.log"]
    assert r.stdout.splitlines()[0] == "overall: FAIL"
    assert len(list(out.iterdir())) == 2  # gpu_check.json and summary.txt, nothing else


def test_a_stage_whose_tests_were_all_skipped_is_not_run(tmp_path):
    """pytest exits 0 when every test skips (no GPU visible): the report does not call
    that a pass."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "stages.tsv").write_text("2\ttests\tpass\t0\t12\t70\n6\tbench\tpass\t0\t9\t45\n")
    (work / "s2.xml").write_text(
        '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="2">'
        '<testcase classname="t" name="test_a"><skipped message="no GPU"/></testcase>'
        '<testcase classname="t" name="test_b"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check_report.py"),
                        str(work), str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["stages"][0]["status"] == "not run (every test skipped: no GPU)"
    assert res["stages"][1]["status"] == "pass"  # no junit report: the shell's verdict
    assert res["overall"] == "not verified (not run: tests)"


def test_emulated_rehearsal_quick(tmp_path):
    """`gpu_check.sh --emulated --quick`: every stage against the emulated GPU, one short
    test each, with the GPU run's pass/fail logic and report."""
    env = _env(tmp_path)
    p = subprocess.run(["bash", SCRIPT, "--emulated", "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    text = p.stdout + p.stderr
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert p.returncode == 0, text[-6000:]
    assert res["overall"] == "pass", res["overall"]
    assert [(s["stage"], s["status"]) for s in res["stages"]] == \
        [(n, "pass") for n in range(1, 7)], text[-4000:]
    for n in range(2, 5):  # each pytest stage ran a test (none skipped away)
        junit = res["stages"][n - 1]["results"][f"s{n}_junit"]
        assert junit["passed"] >= 1 and not junit["failed"], (n, junit)


def test_emulated_stage_that_runs_no_test_fails(tmp_path):
    """The same logic says no: a stage whose tests select nothing fails (pytest's exit
    5), the run exits 1 and the report names the stage."""
    env = _env(tmp_path)
    env["PYTEST_ADDOPTS"] = ("--deselect tests/emu/test_intranode_emu.py::"
                             "test_rank_that_skips_a_call_ends_in_errors_on_every_rank")
    p = subprocess.run(["bash", SCRIPT, "--emulated", "--quick", "--only", "multiprocess"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 1, text[-4000:]
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [s["stage"] for s in res["stages"]] == [3]
    assert res["stages"][0]["status"] == "FAIL (rc 5)" and res["overall"] == "FAIL"
