"""The intranode low-latency CUDA kernels (kernels/cuda/low_latency_kernels.cu) run on the
emulated GPU through the CUDA backend's real-rank handlers: the send and receive halves
as separate calls, bit for bit against the reference backend."""
from __future__ import annotations

import numpy as np
import pytest

from jax_ep.emulator import Emulator

from emu_intranode_util import (LL_DISPATCH_KEYS, assert_same, bits, ll_reference, ll_routing,
                                rows)

pytestmark = pytest.mark.emu


def _setup(R, S, H, K, E, M, dtype, seed, **kw):
    emu = Emulator(R, seed=seed, **kw)
    rb = rows(dtype, (1, 1, H), np.random.default_rng(0)).nbytes
    emu.setup(tokens=S, capacity=S, row_bytes=rb, topk=K, ll_shape=(M, K, E, rb))
    return emu


def _inputs(R, S, H, K, E, M, dtype, seed):
    rng = np.random.default_rng(seed)
    idx = ll_routing(R, S, K, E, rng)
    x = rows(dtype, (R, S, H), rng)
    w = rng.standard_normal((R, S, K)).astype(np.float32)
    y = rows(dtype, (R, E // R, R * M, H), rng)
    return x, idx, w, y


def assert_ll_same(got, want, keys, what=""):
    """assert_same, recv_x compared only in rows below recv_count (rows past it are
    unspecified on GPU: the receive kernel does not write them)."""
    rest = [k for k in keys if k != "recv_x"]
    assert_same(got, want, rest, what)
    if "recv_x" not in keys:
        return
    g, w = np.asarray(got["recv_x"]), np.asarray(want["recv_x"])
    assert g.shape == w.shape, f"{what}recv_x: shape {g.shape} != {w.shape}"
    count = np.asarray(want["recv_count"])
    for r in range(g.shape[0]):
        for e in range(g.shape[1]):
            c = int(count[r, e])
            if not np.array_equal(bits(g[r, e, :c]), bits(w[r, e, :c])):
                bad = np.argwhere(bits(g[r, e, :c]) != bits(w[r, e, :c]))[:5].tolist()
                raise AssertionError(f"{what}recv_x rank {r} expert {e} differs at {bad}")


def _round(emu, x, idx, w, y, *, E, M, K):
    """One dispatch and one combine, each as its send halves then its receive halves."""
    H = x.shape[2]
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    rpd = M * min(K, E // emu.R)
    c = emu.ll_combine_send(y, d["first_row"], d["row_count"], max_tokens=M, rows_per_dest=rpd)
    d["out"] = emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M)
    return d, rpd


QUICK = [(2, 6, 16, 2, 4, 6, "bf16", 1)]
FULL = [
    (2, 1, 8, 1, 2, 1, "f32", 2),     # one token
    (4, 4, 3, 2, 8, 4, "bf16", 3),    # rows of 6 bytes
    (4, 4, 24, 3, 8, 4, "f16", 4),
]


@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", QUICK)
def test_ll_dispatch_combine(R, S, H, K, E, M, dtype, seed):
    emu = _setup(R, S, H, K, E, M, dtype, seed)
    x, idx, w, y = _inputs(R, S, H, K, E, M, dtype, seed)
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"seed {seed}: ")
    assert emu.check_errors() == []


@pytest.mark.emu_full
@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", FULL)
def test_ll_dispatch_combine_full(R, S, H, K, E, M, dtype, seed):
    test_ll_dispatch_combine(R, S, H, K, E, M, dtype, seed)


@pytest.mark.emu_full
def test_ll_consecutive_calls_reuse_halves():
    """Seven rounds on one group: each half (epoch parity) of slots, counts and stages is
    reused three times, its credits returned in between; new data every round."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 5, resident_blocks=2)
    for call in range(7):
        x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 30 + call)
        got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
        want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"call {call}: ")
    assert emu.check_errors() == []


def test_ll_two_sends_in_flight():
    """Two dispatch send halves before either receive half: they use the two halves of
    the buffer, and each receive half reads its own call's rows."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 6)
    a = _inputs(R, S, H, K, E, M, "bf16", 40)
    b = _inputs(R, S, H, K, E, M, "bf16", 41)
    sa = emu.ll_dispatch_send(a[0], a[1], num_experts=E, max_tokens=M)
    sb = emu.ll_dispatch_send(b[0], b[1], num_experts=E, max_tokens=M)
    da = emu.ll_dispatch_recv(sa, num_experts=E, max_tokens=M, H=H, dtype=a[0].dtype)
    db = emu.ll_dispatch_recv(sb, num_experts=E, max_tokens=M, H=H, dtype=b[0].dtype)
    rpd = M * min(K, E // R)
    for got, inp in ((da, a), (db, b)):
        want = ll_reference(*inp, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS)
    assert emu.check_errors() == []


def test_ll_rank_that_skips_a_call_ends_in_errors_on_every_rank():
    """Rank 1 skips a dispatch (both halves): rank 0's receive half times out (its own
    timeout, in virtual time) and returns no rows. Rank 1 is then a call behind: its next
    receive half matches rank 0's earlier send (same call, same tag, the other half of the
    buffer), the one after meets rank 0's failed state, and by then every rank reports."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 7, timeout_s=0.002)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 7)
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M, skip=[1])
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype, skip=[1])
    errs = emu.check_errors()
    assert any("rank 0]" in e for e in errs) and not any("rank 1]" in e for e in errs), errs
    assert (d["recv_count"][0] == 0).all() and (d["src_rank"][0] == -1).all()
    for _ in range(2):
        s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
        emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
        errs += emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == {0, 1}, errs
