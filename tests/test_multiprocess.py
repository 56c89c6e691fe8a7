"""2 local processes x 4 CPU devices (jax.distributed, gloo) form one 8-rank EP axis;
backend 'auto' resolves to the reference there and must match the 1-process result."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import mp_worker
from mp_launch import free_port, run_workers, worker_env
from conftest import assert_bitwise_equal, ep_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 90


def _launch(tmp_path, nproc=2):
    port = free_port()
    argvs = [[sys.executable, os.path.join(HERE, "mp_worker.py"), str(pid), str(nproc),
              str(port), str(tmp_path)] for pid in range(nproc)]
    return run_workers(tmp_path, argvs, worker_env("60"), TIMEOUT_S, tail=4000)


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
