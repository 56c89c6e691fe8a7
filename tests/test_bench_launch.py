"""python -m jax_ep.bench --processes N (jax_ep/bench/launch.py): the launcher, its
workers on CPU processes (gloo) and the merge of their reports. The internode modes run
through the same launcher on GPUs (scripts/gpu_check.sh stage 7); here only what a
machine without a GPU can check. No timing is asserted."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from jax_ep.bench import exchange as bench

from jax_ep.bench import launch as bench_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--ranks", "2", "--tokens", "16", "--hidden", "64", "--experts", "8", "--topk",
         "2", "--repeats", "2", "--warmup", "1", "--memcpy-mib", "8"]


def _run(args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "jax_ep.bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_two_cpu_processes_time_every_op_and_keep_the_routed_rows(tmp_path):
    out = tmp_path / "b.json"
    r = _run(["--processes", "2", "--platform", "cpu", "--backends", "reference",
              "--input-sets", "2", *SMALL, "--json", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    c = rep["config"]
    assert (c["ranks"], c["num_devices"], c["platform"]) == (2, 2, "cpu")
    # What dispatch kept, summed over both processes' shards, is what the routing sends
    # (capacity R * T keeps every row).
    assert c["kept_rows_per_set"]["reference"] == c["rows_per_set"]
    assert len(c["rows_per_set"]) == 2 and all(n > 0 for n in c["rows_per_set"])
    assert [x["op"] for x in rep["results"]] == list(bench.OPS)
    per = {(p["backend"], p["op"]): p["median_s"] for p in rep["launch"]["median_s_per_process"]}
    for x in rep["results"]:
        meds = per[(x["backend"], x["op"])]
        assert len(meds) == 2 and x["median_s"] == max(meds)
        assert x["GBps"] == pytest.approx(x["bytes"] / x["median_s"] / 1e9)
    assert rep["launch"]["processes"] == 2 and rep["launch"]["platform"] == "cpu"
    # without --log-dir the processes' folder is temporary: gone after a successful run
    logs = re.search(r"logs in (\S+) \(removed after a successful run\)", r.stderr)
    assert logs and rep["launch"]["log_dir"] is None and not os.path.exists(logs.group(1))
    # The CPU ffi backend moves rows between the devices of one process only.
    assert "ffi" not in {x["backend"] for x in rep["results"]}


@pytest.mark.slow
def test_two_cpu_processes_low_latency(tmp_path):
    out = tmp_path / "ll.json"
    logs = tmp_path / "logs"
    r = _run(["--mode", "low_latency", "--processes", "2", "--platform", "cpu",
              "--backends", "reference,ffi", *SMALL, "--hidden", "128",  # FP8: 128 | H
              "--json", str(out), "--log-dir", str(logs)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["launch"]["log_dir"] == str(logs)  # --log-dir keeps every process's files
    assert sorted(os.listdir(logs)) == ["proc0.json", "proc0.log", "proc1.json", "proc1.log"]
    assert {x["op"] for x in rep["results"]} == {"dispatch", "dispatch_fp8", "combine",
                                                "roundtrip"}
    assert "ffi" in rep["skipped_backends"] and "2 processes" in rep["skipped_backends"]["ffi"]


@pytest.mark.slow
def test_processes_still_running_at_the_deadline_are_killed_and_named(tmp_path):
    r = _run(["--processes", "2", "--platform", "cpu", "--backends", "reference",
              "--launch-timeout", "1", *SMALL])
    assert r.returncode != 0
    assert "processes [0, 1] still ran after 1 s (--launch-timeout) and were killed" in r.stderr
    logs = re.search(r"were killed; logs in (\S+)", r.stderr)
    assert logs and os.path.exists(os.path.join(logs.group(1), "proc1.log"))  # kept


def _proc_json(tmp_path, i, results=None, error=None):
    rep = {"error": error} if error else {
        "config": {"ranks": 2}, "memcpy_GBps": 1.0, "results": results}
    (tmp_path / f"proc{i}.json").write_text(json.dumps(rep))


def _res(op, med, lo, hi, nbytes=8e9):
    return {"backend": "reference", "op": op, "median_s": med, "min_s": lo, "max_s": hi,
            "bytes": nbytes, "GBps": nbytes / med / 1e9}


def test_merge_reports_the_slowest_process(tmp_path):
    _proc_json(tmp_path, 0, [_res("dispatch", 2.0, 1.0, 3.0), _res("combine", 4.0, 3.5, 4.5)])
    _proc_json(tmp_path, 1, [_res("dispatch", 4.0, 0.5, 5.0), _res("combine", 1.0, 0.9, 6.0)])
    rep = bench_launch.merge(str(tmp_path), 2)
    d, c = rep["results"]
    assert (d["median_s"], d["min_s"], d["max_s"], d["GBps"]) == (4.0, 0.5, 5.0, 2.0)
    assert (c["median_s"], c["min_s"], c["max_s"], c["GBps"]) == (4.0, 0.9, 6.0, 2.0)
    assert rep["launch"]["median_s_per_process"] == [
        {"backend": "reference", "op": "dispatch", "median_s": [2.0, 4.0]},
        {"backend": "reference", "op": "combine", "median_s": [4.0, 1.0]}]


def test_merge_names_a_failed_or_silent_process(tmp_path):
    _proc_json(tmp_path, 0, [_res("dispatch", 2.0, 1.0, 3.0)])
    with pytest.raises(SystemExit, match="process 1 wrote no result"):
        bench_launch.merge(str(tmp_path), 2)
    _proc_json(tmp_path, 1, error="RuntimeError: jax_ep: timed out")
    with pytest.raises(SystemExit, match=r"1 of 2 processes failed \(logs in .*\); process 1: RuntimeError"):
        bench_launch.merge(str(tmp_path), 2)
    _proc_json(tmp_path, 1, [_res("combine", 2.0, 1.0, 3.0)])
    with pytest.raises(SystemExit, match="timed different"):
        bench_launch.merge(str(tmp_path), 2)


@pytest.mark.parametrize("args,msg", [
    (["--processes", "3", "--ranks", "2"], "--processes 3 runs one rank per process"),
    (["--processes", "4", "--ranks", "4", "--gpus-per-node", "3"],
     "--gpus-per-node must divide --processes 4"),
    (["--processes", "0", "--ranks", "0"], "--processes must be >= 1"),
    (["--processes", "2", "--ranks", "2", "--virtual-ranks"], "--virtual-ranks runs every"),
    (["--processes", "2", "--ranks", "2", "--platform", "tpu"], "--platform must be auto"),
])
def test_launch_arguments_are_checked_before_any_process_starts(args, msg):
    with pytest.raises(SystemExit, match=msg):
        bench.main(args)


def test_bench_argument_errors_come_from_the_launcher(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--processes", "2", "--ranks", "2", "--experts", "7"])
    assert "--experts 7 must be a multiple of --ranks 2" in capsys.readouterr().err


def test_worker_environment():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
            "HOME": "/h"}
    e = bench_launch.worker_env(processes=4, gpus=1, nvshmem=True,
                                internode_mode="hierarchical", gpus_per_node="2",
                                platform="gpu", environ=base)
    assert "XLA_FLAGS" not in e and "JAX_PLATFORMS" not in e and e["HOME"] == "/h"
    assert (e["JAX_EP_INTERNODE_MODE"], e["JAX_EP_GPUS_PER_NODE"]) == ("hierarchical", "2")
    assert e["NVSHMEM_REMOTE_TRANSPORT"] == "none" and e["NVSHMEM_DISABLE_NCCL"] == "1"
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # 4 processes on one GPU
    e = bench_launch.worker_env(processes=8, gpus=8, nvshmem=False, internode_mode=None,
                                gpus_per_node=None, platform="gpu", environ=base)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e and "JAX_EP_INTERNODE_MODE" not in e
    e = bench_launch.worker_env(processes=6, gpus=4, nvshmem=False, internode_mode=None,
                                gpus_per_node=None, platform="gpu", environ=base)
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # at most 2 processes a GPU
    # the internode low-latency mode: NVSHMEM on this machine, no normal-mode choice
    e = bench_launch.worker_env(processes=2, gpus=2, nvshmem=True, internode_mode=None,
                                gpus_per_node=None, platform="gpu", environ=base)
    assert e["NVSHMEM_REMOTE_TRANSPORT"] == "none" and "JAX_EP_INTERNODE_MODE" not in e
    assert bench_launch.MODES["internode_low_latency"] == ("low_latency", True, None)


def test_local_gpus_reads_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,3")
    assert bench_launch.local_gpus() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert bench_launch.local_gpus() == 0


def test_a_log_dir_holding_an_earlier_run_is_refused(tmp_path):
    (tmp_path / "proc0.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--log-dir .* already holds \['proc0.json'\]"):
        bench.main(["--processes", "2", "--ranks", "2", "--platform", "cpu",
                    "--log-dir", str(tmp_path)])


@pytest.mark.parametrize("flag", [["--gpus-per-node", "2"], ["--platform", "cpu"],
                                  ["--launch-timeout", "5"], ["--log-dir", "logs"]])
def test_launch_flags_without_processes_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--ranks", "2", *flag])
    assert f"{flag[0]} only go with --processes" in capsys.readouterr().err
