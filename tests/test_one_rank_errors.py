"""Bad routing ids on one rank: every rank raises the same jax_ep error, in one process
(8 CPU devices) and across two (2 x 4 CPU devices, jax.distributed), and the next good
call works.

A rank that stopped alone would leave its peers in a collective: XLA's CPU rendezvous
aborts the process after 40 s, a `jax.distributed` job hangs. So every case runs in a
worker process (tests/one_rank_worker.py) under a deadline; each checked value (ids
outside [-1, E) in the normal and low-latency dispatch and in the low-latency combine,
repeated ids in the low-latency mode, the layout's ids) is tried bad on rank 0 only, on
the last rank only and on every rank, per shard, in the global view and in the Flax
layer, for the reference and ffi backends.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import one_rank_worker as w
from mp_launch import free_port, run_workers, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "one_rank_worker.py")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # A kernel wait longer than the rendezvous abort: a stuck peer shows as the abort.
    env.update(JAX_EP_TIMEOUT_S="60", PYTHONUNBUFFERED="1")
    return env


def _check_log(text, expected_cases, what):
    """Every expected case line RAISED then OK, nothing FAILed, the worker got to DONE."""
    fails = [ln for ln in text.splitlines() if " FAIL " in ln or ln.startswith("ERROR")]
    assert not fails, f"{what}:\n" + "\n".join(fails) + "\n" + text[-3000:]
    ok = re.findall(r"^CASE (\S+) (\w+) OK$", text, re.M)
    raised = re.findall(r"^CASE (\S+) (\w+) RAISED [\d.]+$", text, re.M)
    assert sorted(ok) == sorted(expected_cases), f"{what}: cases OK {ok}\n{text[-3000:]}"
    assert sorted(raised) == sorted(expected_cases), text[-3000:]
    assert "\nDONE" in text, text[-3000:]


def _expected(group, backends):
    return [(f"{name}[{b}]", p) for name, *_ in w.CASES[group] for b in backends
            for p in w.PLACEMENTS]


def _run_one(group, timeout):
    try:
        r = subprocess.run([sys.executable, WORKER, group], env=_env(), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"worker still running after {timeout} s (a rank left waiting?); "
                    f"last lines:\n{out[-3000:]}")
    assert r.returncode == 0, (f"worker exit {r.returncode} (134: XLA's rendezvous abort)"
                               f"\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


@pytest.mark.parametrize("group", ["shard", "global"])
def test_one_rank_bad_ids_raise_everywhere(group):
    """Per shard (jax_ep.dispatch, get_dispatch_layout, jax_ep.low_latency whole and in
    halves) and global view (jax_ep.sharded, jax_ep._src.sharded_low_latency)."""
    out = _run_one(group, timeout=900)
    _check_log(out, _expected(group, ("reference", "ffi")), f"group {group}")


def test_flax_layer_bad_routing_raises_everywhere():
    """jax_ep.flax.MoE on a (data, expert) mesh, two EP groups: the error of one shard
    reaches the other group too (the layer's psum over the data axis follows)."""
    out = _run_one("flax", timeout=900)
    want = [(f"flax_{m}[{b}]", p) for m in ("normal", "low_latency")
            for b in ("reference", "ffi") for p in w.PLACEMENTS]
    _check_log(out, want, "flax")


@pytest.mark.slow
def test_two_processes_bad_ids_raise_in_both(tmp_path):
    """2 processes x 4 CPU devices (jax.distributed, gloo; 'auto' is the reference
    backend): rank 0 lives in process 0, rank 7 in process 1; each case raises in both
    processes and the next call works."""
    port = free_port()
    argvs = [[sys.executable, WORKER, "multiprocess", str(pid), "2", str(port)]
             for pid in range(2)]
    procs, hung, logs = run_workers(tmp_path, argvs, worker_env("60"), 600, tail=200000)
    assert not hung, f"processes {hung} still running (left waiting?)\n{logs[-6000:]}"
    assert all(p.returncode == 0 for p in procs), logs[-6000:]
    parts = re.split(r"^--- process \d+ \(rc -?\d+\) ---$", logs, flags=re.M)[1:]
    assert len(parts) == 2, logs[-6000:]
    for pid, text in enumerate(parts):
        _check_log(text, _expected("multiprocess", ("auto",)), f"process {pid}")
