"""2 local processes x 4 CPU devices (jax.distributed, gloo) form one 8-rank EP axis;
backend 'auto' resolves to the reference there and must match the 1-process result."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import mp_worker
from conftest import assert_bitwise_equal, ep_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(tmp_path, nproc=2):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_EP_TIMEOUT_S"] = "60"
    procs = []
    logs = []
    for pid in range(nproc):
        log = open(tmp_path / f"proc{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "mp_worker.py"), str(pid), str(nproc),
             str(port), str(tmp_path)], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.pid for p in procs if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = []
    for pid, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {pid} (rc {procs[pid].returncode}) ---\n{log.read()[-4000:]}")
        log.close()
    return procs, timed_out, "\n".join(text)


def _assemble(tmp_path, nproc=2):
    parts, meta = {}, []
    for pid in range(nproc):
        with np.load(tmp_path / f"proc{pid}.npz") as z:
            meta.append((str(z["resolved"]), bool(z["ffi_refused"])))
            for key in z.files:
                if "@" in key:
                    name, start = key.split("@")
                    parts.setdefault(name, {})[int(start)] = z[key]
    full = {name: np.concatenate([chunks[s] for s in sorted(chunks)])
            for name, chunks in parts.items()}
    return full, meta


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    procs, timed_out, logs = _launch(tmp_path)
    assert not timed_out, f"workers {timed_out} still running after {TIMEOUT_S} s\n{logs}"
    assert all(p.returncode == 0 for p in procs), logs
    got, meta = _assemble(tmp_path)
    assert meta == [("reference", True)] * 2, meta

    g = mp_worker.global_inputs()
    args = (g["x"], g["idx"], g["w"], g["y"])
    for backend in ("ffi", "reference"):
        want = mp_worker.program(ep_mesh(mp_worker.R), backend)(*args)
        want = {k: np.asarray(v) for k, v in want.items()}
        assert set(got) == set(want)
        assert_bitwise_equal(got, want, what=f"2 processes vs 1 process ({backend}): ")
    assert got["num_dropped"].sum() > 0  # the capacity cut is exercised
