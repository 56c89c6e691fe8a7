"""The internode low-latency mode's kernel sources on the emulated GPU (send and receive
halves through their own FFI handlers, over the emulated NVSHMEM), bit-exact against the
reference backend."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from emu_intranode_util import (LL_DISPATCH_KEYS, assert_same, ll_reference,  # noqa: E402
                                ll_routing, rows)
from internode_emu_util import InternodeEmu  # noqa: E402

pytestmark = pytest.mark.emu
full = pytest.mark.emu_full


def setup(R, S, H, K, E, M, dtype, seed, ports=2, qpp=1):
    em = InternodeEmu(R, num_ports=ports, qps_per_port=qpp, seed=seed)
    itemsize = rows(dtype, (1,), np.random.default_rng(0)).dtype.itemsize
    em.ll_init(max_tokens=M, row_bytes=H * itemsize, topk=K, num_experts=E)
    return em


def inputs(R, S, H, K, E, M, dtype, rng):
    idx = ll_routing(R, S, K, E, rng)
    x = rows(dtype, (R, S, H), rng)
    w = rng.standard_normal((R, S, K)).astype(np.float32)
    y = rows(dtype, (R, E // R, R * M, H), rng)
    return x, idx, w, y


def one_round(em, x, idx, w, y, *, K, skip=()):
    R, S, H = x.shape
    E, M = em.ll["num_experts"], em.ll["max_tokens"]
    tok, errs = em.ll_dispatch_send(x, idx, skip=skip)
    assert errs == [""] * R, errs
    d, errs = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype, skip=skip)
    assert errs == [""] * R, errs
    if skip:
        return d, None
    rpd = M * min(K, E // R)
    first = np.stack([o["first_row"] for o in d])
    count = np.stack([o["row_count"] for o in d])
    tok, errs = em.ll_combine_send(y, first, count, rows_per_dest=rpd)
    assert errs == [""] * R, errs
    out, errs = em.ll_combine_recv(tok, idx, w, H=H, dtype=x.dtype)
    assert errs == [""] * R, errs
    got = {k: np.stack([o[k] for o in d]) for k in LL_DISPATCH_KEYS}
    got["out"] = np.stack(out)
    return got, rpd


CASES = [(4, 5, 8, 2, 8, 6, "bf16", 1), pytest.param(4, 3, 3, 3, 8, 4, "f32", 2, marks=full),
         pytest.param(2, 1, 24, 1, 4, 1, "f16", 3, marks=full)]


@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", CASES)
def test_ll_matches_reference(R, S, H, K, E, M, dtype, seed):
    em = setup(R, S, H, K, E, M, dtype, seed)
    rng = np.random.default_rng(seed)
    x, idx, w, y = inputs(R, S, H, K, E, M, dtype, rng)
    got, rpd = one_round(em, x, idx, w, y, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_same(got, want, LL_DISPATCH_KEYS + ("out",), f"seed {seed}: ")
    assert em.errors() == [""] * R


@pytest.mark.parametrize("seed,max_delay", [(11, 32), (12, 4000)])
def test_ll_consecutive_calls_reuse_halves_parities_and_credits(seed, max_delay):
    """Eight rounds (dispatch and combine each: four wraps of the two parity halves and of
    the credits the readers hand back) with fresh routing and rows every round: each round
    bit-exact, so a half reused before its credit, or read with last round's parity, shows.
    With long transport delays puts are still queued when the sender packs its stage for
    the next call: only the send's quiet keeps their source bytes (read at delivery)."""
    R, S, H, K, E, M = 4, 3, 8, 2, 8, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=seed, max_delay=max_delay)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(seed)
    for i in range(8):
        x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
        got, rpd = one_round(em, x, idx, w, y, K=K)
        want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
        assert_same(got, want, LL_DISPATCH_KEYS + ("out",), f"round {i}: ")
    assert em.errors() == [""] * R


def test_ll_rank_that_skips_a_call_ends_in_errors_on_every_rank():
    """Rank 1 skips a dispatch (both halves): rank 0's receive half times out waiting for
    rank 1's rows. Rank 1 is then a call behind, so later calls meet rank 0's failed state
    or time out themselves: within a few calls every rank reports an error, none hangs."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=5, timeout_s=0.002)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(5)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
    tok, errs = em.ll_dispatch_send(x, idx, skip=[1])
    d, errs2 = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype, skip=[1])
    # a failed receive half marks its results: counts and first rows -1, sources -1
    assert d[1] is None and (d[0]["recv_count"] == -1).all(), d[0]["recv_count"]
    assert (d[0]["src_rank"] == -1).all() and (d[0]["row_count"] == -1).all()
    failed = {r for r, e in enumerate(em.ll_errors()) if e}
    assert 0 in failed and "skipped the call" in em.ll_errors()[0], em.ll_errors()
    for _ in range(3):
        tok, errs = em.ll_dispatch_send(x, idx)
        d, errs2 = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
        failed |= {r for r, e in enumerate(errs) if e} | {r for r, e in enumerate(errs2) if e}
        failed |= {r for r, e in enumerate(em.ll_errors()) if e}
    assert failed == {0, 1}, em.ll_errors()
    # the other modes' decoders name a low-latency record instead of misreading its fields
    assert all("earlier internode low-latency call failed" in e for e in em.errors())


@pytest.mark.parametrize("seed,max_delay", [(13, 32), (14, 4000)])
def test_ll_two_sends_in_flight(seed, max_delay):
    """Two dispatch send halves before either receive half (the FP8 pattern), three times:
    the second send packs the send stage again while, with long transport delays, the
    first one's puts (their source read at delivery) are still queued, so only the first
    send's quiet keeps its rows. Both receives bit-exact."""
    R, S, H, K, E, M = 4, 3, 8, 2, 8, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=seed, max_delay=max_delay)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(seed)
    rpd = M * min(K, E // R)
    for i in range(3):
        a = inputs(R, S, H, K, E, M, "bf16", rng)
        b = inputs(R, S, H, K, E, M, "bf16", rng)
        ta, errs = em.ll_dispatch_send(a[0], a[1])
        assert errs == [""] * R, errs
        tb, errs = em.ll_dispatch_send(b[0], b[1])
        assert errs == [""] * R, errs
        for tok, inp, name in ((ta, a, "first"), (tb, b, "second")):
            d, errs = em.ll_dispatch_recv(tok, H=H, dtype=np.dtype(inp[0].dtype), skip=())
            assert errs == [""] * R, errs
            got = {k: np.stack([o[k] for o in d]) for k in LL_DISPATCH_KEYS}
            want = ll_reference(*inp, E=E, M=M, rows_per_dest=rpd)
            assert_same(got, want, LL_DISPATCH_KEYS, f"seed {seed} round {i} {name}: ")
    assert em.ll_errors() == [""] * R
