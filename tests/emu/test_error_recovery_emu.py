"""After a protocol error, check_errors() reports it but does not put the kernels back
to work: the buffer headers are out of step (a rank a call ahead, counts and call sites
of another epoch), and only jax_ep.cuda.reset(), which re-zeroes them, lifts the failed
state. So the EP call after an error either works (after reset) or moves no data and is
reported again; it never reads stale headers. Run on the emulated GPU (the kernels and
the host functions of the CUDA backend, compiled for the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

from jax_ep._src.emu import Emulator

from emu_intranode_util import DISPATCH_KEYS, assert_same, reference, routing, rows

pytestmark = pytest.mark.emu

R, T, H, K, E, C = 2, 6, 16, 2, 4, 12


def _case(seed):
    rng = np.random.default_rng(seed)
    idx = routing("random", R, T, K, E, rng)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    return x, idx, w


def _timed_out(seed=21):
    emu = Emulator(R, seed=seed, timeout_s=0.002)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    x, idx, w = _case(seed)
    emu.dispatch(x, idx, w, num_experts=E, capacity=C, skip=[1])  # rank 1 makes no call
    errs = emu.check_errors()  # reads and clears the record
    assert any("timed out" in e for e in errs), errs
    return emu


def test_check_errors_keeps_reporting_until_reset():
    emu = _timed_out()
    again = emu.check_errors()
    assert again and all("jax_ep.cuda.reset()" in e for e in again), again
    emu.m.cuda_reset()
    assert emu.check_errors() == []


def test_the_next_call_after_check_errors_moves_no_data_and_is_reported():
    emu = _timed_out()
    x, idx, w = _case(22)
    got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    errs = emu.check_errors()
    # Every rank is told: rank 0 is still failed, rank 1 hears it as a failed peer
    # instead of reading rank 0's header of another epoch.
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == {0, 1}, errs
    assert (got["num_recv"] == 0).all() and (got["src_rank"] == -1).all()


def test_after_reset_the_next_call_works():
    emu = _timed_out()
    emu.m.cuda_reset()
    x, idx, w = _case(23)
    zeros = np.zeros((R, C, H), x.dtype)
    got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    assert emu.check_errors() == []
    want = reference(x, idx, w, zeros, np.zeros_like(x), E=E, C=C)
    assert_same(got, want, DISPATCH_KEYS)


def test_low_latency_failed_state_outlives_check_errors():
    """The same for the low-latency mode: its failed flag stays after check_errors()
    and is reported again (naming reset()); after reset the mode works again."""
    from emu_intranode_util import ll_routing
    M, KL, EL = 4, 2, 4
    emu = Emulator(R, seed=31, timeout_s=0.002)
    rb = H * 2
    emu.setup(tokens=M, capacity=M, row_bytes=rb, topk=KL, ll_shape=(M, KL, EL, rb))
    rng = np.random.default_rng(31)
    idx = ll_routing(R, M, KL, EL, rng)
    x = rows("bf16", (R, M, H), rng)
    s = emu.ll_dispatch_send(x, idx, num_experts=EL, max_tokens=M, skip=[1])
    emu.ll_dispatch_recv(s, num_experts=EL, max_tokens=M, H=H, dtype=x.dtype, skip=[1])
    assert any("rank 0]" in e for e in emu.check_errors())
    again = emu.check_errors()
    assert any("low-latency" in e and "jax_ep.cuda.reset()" in e for e in again), again
    emu.m.cuda_reset()
    assert emu.check_errors() == []
    s = emu.ll_dispatch_send(x, idx, num_experts=EL, max_tokens=M)
    d = emu.ll_dispatch_recv(s, num_experts=EL, max_tokens=M, H=H, dtype=x.dtype)
    assert emu.check_errors() == []
    assert d["recv_count"].sum() == (idx >= 0).sum()


def test_a_new_emulator_keeps_none_of_the_last_ones_streams():
    """Each emulator (configure) makes one stream per virtual GPU; the last one's streams
    go with it. The scheduler visits every stream at every step, so kept streams would
    slow every later run of the process (they did: twice as slow late in the suite), and
    a stream destroyed too eagerly would break the next call."""
    counts = []
    for seed in (31, 32, 33):
        emu = Emulator(R, seed=seed)
        counts.append(emu.m.num_streams())
        emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
        x, idx, w = _case(seed)
        got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
        assert emu.check_errors() == []
        want = reference(x, idx, w, np.zeros((R, C, H), x.dtype), np.zeros_like(x), E=E, C=C)
        assert_same(got, want, DISPATCH_KEYS)
    assert counts[0] == counts[1] == counts[2], counts
