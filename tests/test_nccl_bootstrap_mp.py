"""The NCCL start-up agreement across 2 processes x 4 CPU devices (jax.distributed's real
key-value store, a stand-in for the native calls): one world of 8 ranks, one unique id,
disjoint rank blocks; a TransportConfig that differs is named by field on both
processes; a process that never arrives ends its peer's start-up in an error, bounded."""
from __future__ import annotations

import json
import os
import sys
import time

from mp_launch import free_port, run_workers, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 40


def _run(tmp_path, scenario: str, timeout_s: float):
    port = free_port()
    argvs = [[sys.executable, os.path.join(HERE, "mp_nccl_worker.py"), str(pid), "2",
              str(port), scenario, str(timeout_s)] for pid in range(2)]
    t0 = time.monotonic()
    procs, hung, logs = run_workers(tmp_path, argvs, worker_env(), DEADLINE_S, tail=4000)
    wall = time.monotonic() - t0
    assert not hung, f"workers {hung} still running after {DEADLINE_S} s\n{logs}"
    assert all(p.returncode == 0 for p in procs), logs
    out = []
    for pid in range(2):
        text = (tmp_path / f"proc{pid}.log").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("START ", "ERROR ",
                                                                  "ABSENT"))]
        assert len(lines) == 1, text[-3000:]
        kind, _, body = lines[0].partition(" ")
        out.append((kind, json.loads(body) if body else None))
    return out, wall, logs


def test_two_processes_agree_on_one_world(tmp_path):
    (k0, s0), (k1, s1) = _run(tmp_path, "agree", 20)[0]
    assert (k0, k1) == ("START", "START"), (s0, s1)
    assert s0["world"] == s1["world"] == 8
    assert s0["uid"] == s1["uid"] and len(bytes.fromhex(s0["uid"])) == 128
    assert s0["ranks"] == [0, 1, 2, 3] and s1["ranks"] == [4, 5, 6, 7]
    assert s0["ordinals"] == s1["ordinals"] == [0, 1, 2, 3]  # each process's own devices
    for k in ("heap_bytes", "num_contexts", "gpus_per_node"):
        assert s0[k] == s1[k], k
    assert s0["num_contexts"] == 8  # the default plan's QPs: 2 ports x 4
    assert s0["gpus_per_node"] == 4  # one process per host of 4 devices


def test_a_different_transport_config_is_named_on_both(tmp_path):
    (k0, e0), (k1, e1) = _run(tmp_path, "mismatch", 20)[0]
    assert (k0, k1) == ("ERROR", "ERROR"), (e0, e1)
    for e in (e0, e1):
        assert "process 1 has transport_config.num_ports=1 where process 0 has 2" in \
            e["error"], e["error"]
        assert "no NCCL call was made" in e["error"]


def test_a_process_that_never_arrives_is_an_error_in_bounded_time(tmp_path):
    timeout_s = 3.0
    (k0, e0), (k1, _), = _run(tmp_path, "absent", timeout_s)[0]
    assert (k0, k1) == ("ERROR", "ABSENT")
    assert "process 1 did not publish its start-up settings" in e0["error"], e0
    assert f"within {timeout_s:g} s" in e0["error"]
    assert timeout_s - 0.5 <= e0["elapsed_s"] < timeout_s + 5, e0
