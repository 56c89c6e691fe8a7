"""Bounded waits on the multi-process CPU path (jax_ep/_src/arrival.py): 2 processes x 4 CPU
devices (jax.distributed, gloo; backend 'auto' = the reference). A peer that does not
make an EP call, or makes it with other shapes, ends the call in an error on every
process that made it, within JAX_EP_TIMEOUT_S, and the next call works."""
from __future__ import annotations

import json
import os
import re
import sys

import jax
import pytest

from mp_launch import free_port, run_workers, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 8  # JAX_EP_TIMEOUT_S of the workers
DEADLINE_S = 150  # the launcher's: a hang is killed and reported


def _run(tmp_path, scenario):
    port = free_port()
    argvs = [[sys.executable, os.path.join(HERE, "mp_arrival_worker.py"), str(pid), "2",
              str(port), str(tmp_path), scenario] for pid in range(2)]
    procs, hung, logs = run_workers(tmp_path, argvs, worker_env(str(TIMEOUT_S)), DEADLINE_S,
                                    tail=4000)
    assert not hung, f"workers {hung} still running after {DEADLINE_S} s (a hang)\n{logs}"
    assert all(p.returncode == 0 for p in procs), logs
    reports = []
    for pid in range(2):
        with open(tmp_path / f"arrival{pid}.json") as f:
            reports.append(json.load(f))
    return reports, logs


def _good(step, logs):
    assert step["error"] is None, f"{step['error']}\n{logs}"


@pytest.mark.slow
def test_missing_peer_times_out_and_next_call_works(tmp_path):
    (p0, p1), logs = _run(tmp_path, "late")
    _good(p0["first"], logs)
    _good(p1["first"], logs)

    # Process 0's second call: process 1 never made it (it slept past the timeout).
    missed = p0["missed"]
    err = missed["error"]
    assert err is not None, f"process 0's call without its peer did not fail\n{logs}"
    assert "timed out after JAX_EP_TIMEOUT_S = 8 s" in err, err
    assert "jax_ep.dispatch at call site" in err, err  # the op and its call site
    assert "did not arrive: process 1 (ep=4, ep=5, ep=6, ep=7)" in err, err
    assert TIMEOUT_S - 0.5 <= missed["secs"] <= TIMEOUT_S + 10, missed["secs"]

    # Process 1's next call reaches the round its peer gave up on: it fails at once.
    late = p1["late"]
    assert late["error"] is not None, f"the late call did not fail\n{logs}"
    assert "after its peers had stopped waiting for it" in late["error"], late["error"]
    assert "did not arrive: process 1 (ep=4, ep=5, ep=6, ep=7)" in late["error"]
    assert late["secs"] < TIMEOUT_S / 2, late["secs"]

    # Both processes stay usable: the next call meets and gives the first call's result.
    for p in (p0, p1):
        _good(p["after"], logs)
        assert p["after"]["same_result"], p


# From jax 0.11 a host callback's error is reported when its program ends, after the
# collectives that follow it ran: ranks that aborted on different shapes then meet in
# mismatched collectives, which end at XLA's CPU collective timeout (set by jax_ep at
# import, JAX_EP_TIMEOUT_S + 60), and the processes cannot go on after that.
CALLBACK_ERRORS_STOP = jax.__version_info__ < (0, 11)


@pytest.mark.slow
def test_peer_with_other_shapes_fails_on_every_process(tmp_path):
    reports, logs = _run(tmp_path, "mismatch")
    for p in reports:
        _good(p["first"], logs)
        step = p["mismatch"]
        err = step["error"]
        assert err is not None, (f"process {p['pid']}: a call with other shapes passed\n"
                                 f"{logs}")
        if not CALLBACK_ERRORS_STOP:  # an error, not a hang; the barrier's said first
            assert "made this call with different arguments" in logs, logs
            assert "made this call with different arguments" in err or "Gloo" in err, err
            assert step["secs"] < TIMEOUT_S + 90, step["secs"]
            continue
        assert "made this call with different arguments" in err, err
        assert "jax_ep.dispatch at call site" in err, err
        # Both signatures, each with the ranks and process that made it (T = 5 vs 6
        # tokens; the ranks that had not arrived yet when it was decided are listed apart).
        for pid, T, ranks in ((0, 5, "[0-3]"), (1, 6, "[4-7]")):
            want = (rf"process {pid} \(ep={ranks}(, ep={ranks})*\): "
                    rf"jax_ep\.dispatch\(float32\[{T},3\], int32\[{T},2\]")
            assert re.search(want, err), err
        assert step["secs"] < TIMEOUT_S, step["secs"]  # not a timeout: decided at once
        _good(p["after"], logs)
        assert p["after"]["same_result"], p
