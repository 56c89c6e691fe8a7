"""Split-phase ops with the send and receive halves of several rounds in ONE scheduler run.

Each test enqueues every rank's halves of every round (in the rank's stream order) and
then runs the virtual GPUs once, so a fast rank's receive half meets its peers' send halves
still storing or putting, a send half of the next round meets a receive half still
reading, and the credits are the only thing that keeps a half from being rewritten early:
the windows a GPU opens and round-by-round calls (one synchronize per half) never do.
Intranode low latency (kernels/cuda/low_latency_kernels.cu) and internode low latency
over the emulated NVSHMEM (kernels/internode/low_latency_kernels.cu): dispatch and combine,
every round bit-exact against the reference backend below the counts.

The receive halves get their epoch as their send half would hand it over (intranode: the
round's number in stage_idx / status; internode: the token's epoch and config hash, the
hash taken from a first round run half by half); combine's send halves get the dispatch
handle the reference computes, which the same round's dispatch must equal (checked).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from jax_ep._src.emu import EmuError, _code  # noqa: E402

from emu_intranode_util import LL_DISPATCH_KEYS, assert_same, ll_reference  # noqa: E402
from test_internode_ll_emu import below_count  # noqa: E402
from test_internode_ll_emu import inputs as internode_inputs  # noqa: E402
from test_internode_ll_emu import setup as internode_setup  # noqa: E402
from test_low_latency_emu import _inputs, _setup, assert_ll_same  # noqa: E402

pytestmark = pytest.mark.emu
full = pytest.mark.emu_full


def _ins(arrs):
    return [(np.ascontiguousarray(a).tobytes(), list(np.shape(a)), _code(np.asarray(a).dtype))
            for a in arrs]


def _outs(spec):
    return [(list(s), _code(d)) for s, d in spec]


def _stream_order(n_rounds, order):
    """(half, round) in each rank's stream order. lockstep: a round's four halves, then the
    next round's; two_in_flight: two rounds' dispatch sends before either receive half,
    then the same for combine (two sends in flight per op, both parities live);
    combines_in_flight: one dispatch, then its handle combined once per round, two combine
    sends before either receive half (no dispatch between the combines, so an owner's
    third combine send can meet a source still reading the first: only the credit stops
    it)."""
    halves = ("dsend", "drecv", "csend", "crecv")
    if order == "lockstep":
        return [(h, i) for i in range(n_rounds) for h in halves]
    assert n_rounds % 2 == 0
    if order == "two_in_flight":
        return [(h, i) for a in range(0, n_rounds, 2) for h in halves for i in (a, a + 1)]
    return [("dsend", 0), ("drecv", 0)] + [
        (h, i) for a in range(0, n_rounds, 2) for h in halves[2:] for i in (a, a + 1)]


def _one_dispatch(rounds):
    """combines_in_flight's rounds: round 0's x, ids and weights throughout, each round's
    own y (the same dispatch handle combined again, as a backward pass does)."""
    x, idx, w, _ = rounds[0]
    return [(x, idx, w, r[3]) for r in rounds]


def _rounds(order):
    return 8 if order == "combines_in_flight" else 4


def _preempt(order):
    """combines_in_flight parks a block now and then (40 us): a source's combine receive
    half parked mid-read while its owners run ahead to the next send into that half."""
    return dict(preempt_prob=0.002, preempt_ns=40e3) if order == "combines_in_flight" else {}


def _keys(got):
    """The fields a round returned: the dispatch's and combine's out, or out alone."""
    return tuple(k for k in LL_DISPATCH_KEYS + ("out",) if k in got)


def _collect(m, ids, spec):
    err, blobs = m.result(ids)
    assert err == "", err
    return [np.frombuffer(b, dtype=np.dtype(d)).reshape(s).copy() for b, (s, d) in zip(blobs, spec)]


# --------------------------------------------------------------- intranode low latency

def intranode_one_run(emu, rounds, wants, *, E, M, K, order):
    """Every round's four halves on every rank in one scheduler run. rounds: (x, idx, w, y);
    wants: the reference per round (its first_row / row_count feed combine's send half).
    Returns per round a dict of the dispatch outputs and combine's out, leading rank axis."""
    R = emu.R
    el = E // R
    rpd = M * min(K, el)
    ids = [dict() for _ in rounds]
    for r in range(R):  # rank by rank: nothing may run before the synchronize
        for half, i in _stream_order(len(rounds), order):
            x, idx, w, y = rounds[i]
            n = i + 1  # the epoch of round i on a fresh group (dispatch and combine alike)
            S, H = x.shape[1], x.shape[2]
            if half == "dsend":
                at = dict(num_experts=E, num_ranks=R, max_tokens=M, call_site=1)
                spec = [((0, H), x.dtype), ((S, K), np.int32), ((E,), np.int32)]
                cid = emu.m.enqueue("ll_dispatch_send", r, _ins([x[r], idx[r]]), _outs(spec), at)
            elif half == "drecv":
                at = dict(num_experts=E, num_ranks=R, max_tokens=M, call_site=1)
                spec = [((el, R * M, H), x.dtype), ((el,), np.int32), ((el, R * M), np.int32),
                        ((el, R * M), np.int32), ((el, R), np.int32), ((el, R), np.int32)]
                cid = emu.m.enqueue("ll_dispatch_recv", r, _ins(
                    [np.zeros((0, H), x.dtype), np.full((S, K), n, np.int32),
                     np.zeros(E, np.int32), *emu._scalars(r)]), _outs(spec), at)
            elif half == "csend":
                at = dict(num_ranks=R, max_tokens=M, rows_per_dest=rpd, call_site=2)
                spec = [((R, 0, H), y.dtype), ((), np.int32)]
                cid = emu.m.enqueue("ll_combine_send", r, _ins(
                    [y[r], wants[i]["first_row"][r], wants[i]["row_count"][r]]), _outs(spec), at)
            else:
                at = dict(num_experts=E, num_ranks=R, max_tokens=M, call_site=2)
                spec = [((S, H), y.dtype)]
                cid = emu.m.enqueue("ll_combine_recv", r, _ins(
                    [np.zeros((R, 0, H), y.dtype), np.array(n, np.int32), idx[r], w[r],
                     *emu._scalars(r)]), _outs(spec), at)
            ids[i].setdefault(half, []).append((cid, spec))
    faults = emu.m.synchronize()
    if faults:
        raise EmuError(f"emulated GPU (seed {emu.seed}): " + "; ".join(faults))
    results = []
    for per in ids:
        got = [_collect(emu.m, cid, spec) for cid, spec in per.get("drecv", [])]
        d = {k: np.stack([g[j] for g in got]) for j, k in enumerate(LL_DISPATCH_KEYS) if got}
        # the send halves hand over the epochs the receive halves were given
        n = len(results) + 1
        for cid, spec in per.get("dsend", []):
            assert _collect(emu.m, cid, spec)[1][0, 0] == n
        for cid, spec in per["csend"]:
            assert _collect(emu.m, cid, spec)[1] == n
        d["out"] = np.stack([_collect(emu.m, cid, spec)[0] for cid, spec in per["crecv"]])
        results.append(d)
    return results


@pytest.mark.parametrize("R,seed,order", [
    (2, 1, "lockstep"),
    (2, 2, "two_in_flight"),
    (2, 8, "combines_in_flight"),
    pytest.param(4, 7, "combines_in_flight", marks=full),
    pytest.param(2, 6, "combines_in_flight", marks=full),
    pytest.param(2, 3, "lockstep", marks=full),
    pytest.param(4, 4, "two_in_flight", marks=full),
    pytest.param(4, 5, "lockstep", marks=full),
])
def test_ll_combine_halves_in_one_run(R, seed, order):
    """Four rounds of dispatch and combine, all halves in one run, two resident blocks:
    a source's combine receive half meets owners whose combine send halves still store
    rows (and, two_in_flight, owners already sending the next round into the other
    parity); the words must follow the rows and the sends wait for their credits. Every
    round's handle and combined rows bit-exact."""
    S, H, K, E, M = 6, 64, 2, 2 * R, 6
    emu = _setup(R, S, H, K, E, M, "bf16", seed, resident_blocks=2, **_preempt(order))
    rounds = [_inputs(R, S, H, K, E, M, "bf16", 1000 * seed + i) for i in range(_rounds(order))]
    if order == "combines_in_flight":
        rounds = _one_dispatch(rounds)
    rpd = M * min(K, E // R)
    wants = [ll_reference(*inp, E=E, M=M, rows_per_dest=rpd) for inp in rounds]
    got = intranode_one_run(emu, rounds, wants, E=E, M=M, K=K, order=order)
    for i, (g, want) in enumerate(zip(got, wants)):
        assert_ll_same(g, want, _keys(g), f"seed {seed} {order} round {i}: ")
    assert emu.check_errors() == []


# --------------------------------------------------------------- internode low latency

def internode_one_run(em, rounds, wants, first_tokens, *, K, order):
    """As intranode_one_run over the emulated NVSHMEM: first_tokens = (dispatch, combine)
    tokens [R, 2] of the round run before, whose epochs the rounds here continue and whose
    config hashes they carry."""
    R = em.R
    E, M = em.ll["num_experts"], em.ll["max_tokens"]
    el = E // R
    rpd = M * min(K, el)
    base = dict(num_ranks=R, num_ports=em.P, qps_per_port=em.Q, call_site=0, **em.ll)
    m = em.emu.m
    em._tag()  # one call number for the whole run's puts
    ids = [dict() for _ in rounds]
    for r in range(R):  # rank by rank: nothing may run before the synchronize
        for half, i in _stream_order(len(rounds), order):
            x, idx, w, y = rounds[i]
            S, H = x.shape[1], x.shape[2]
            tok_d = np.array([first_tokens[0][r][0] + 1 + i, first_tokens[0][r][1]], np.int32)
            tok_c = np.array([first_tokens[1][r][0] + 1 + i, first_tokens[1][r][1]], np.int32)
            at = dict(base, rank=r)
            if half == "dsend":
                spec = [((2,), np.int32)]
                cid = m.enqueue("internode_ll_dispatch_send", r, _ins([x[r], idx[r]]),
                                _outs(spec), at)
            elif half == "drecv":
                spec = [((el, R * M, H), x.dtype), ((el,), np.int32), ((el, R * M), np.int32),
                        ((el, R * M), np.int32), ((el, R), np.int32), ((el, R), np.int32)]
                cid = m.enqueue("internode_ll_dispatch_recv", r, _ins([tok_d]), _outs(spec), at)
            elif half == "csend":
                spec = [((2,), np.int32)]
                cid = m.enqueue("internode_ll_combine_send", r, _ins(
                    [y[r], wants[i]["first_row"][r], wants[i]["row_count"][r]]), _outs(spec),
                    dict(at, rows_per_dest=rpd))
            else:
                spec = [((S, H), x.dtype)]
                cid = m.enqueue("internode_ll_combine_recv", r, _ins([tok_c, idx[r], w[r]]),
                                _outs(spec), at)
            ids[i].setdefault(half, []).append((cid, spec, r))
    faults = m.synchronize()
    if faults:
        raise EmuError(f"emulated GPU (seed {em.seed}): " + "; ".join(faults))
    results = []
    for i, per in enumerate(ids):
        # the send halves hand over exactly the tokens the receive halves were given
        for half, which in (("dsend", 0), ("csend", 1)):
            for cid, spec, r in per.get(half, []):
                tok = _collect(m, cid, spec)[0]
                want_tok = [first_tokens[which][r][0] + 1 + i, first_tokens[which][r][1]]
                assert tok.tolist() == want_tok, (half, i, r, tok, want_tok)
        got = [_collect(m, cid, spec) for cid, spec, _ in per.get("drecv", [])]
        d = {k: np.stack([g[j] for g in got]) for j, k in enumerate(LL_DISPATCH_KEYS) if got}
        d["out"] = np.stack([_collect(m, cid, spec)[0] for cid, spec, _ in per["crecv"]])
        results.append(d)
    return results


def _internode_first_round(em, x, idx, w, y, *, K, want):
    """One round half by half (each half its own run); returns its (dispatch, combine)
    tokens and checks the round."""
    R, H = x.shape[0], x.shape[2]
    E, M = em.ll["num_experts"], em.ll["max_tokens"]
    tok_d, errs = em.ll_dispatch_send(x, idx)
    assert errs == [""] * R, errs
    d, errs = em.ll_dispatch_recv(tok_d, H=H, dtype=x.dtype)
    assert errs == [""] * R, errs
    first = np.stack([o["first_row"] for o in d])
    count = np.stack([o["row_count"] for o in d])
    tok_c, errs = em.ll_combine_send(y, first, count, rows_per_dest=M * min(K, E // R))
    assert errs == [""] * R, errs
    out, errs = em.ll_combine_recv(tok_c, idx, w, H=H, dtype=x.dtype)
    assert errs == [""] * R, errs
    got = {k: np.stack([o[k] for o in d]) for k in LL_DISPATCH_KEYS}
    got["out"] = np.stack(out)
    assert_same(below_count(got), below_count(want), LL_DISPATCH_KEYS + ("out",), "first: ")
    return [t.copy() for t in tok_d], [t.copy() for t in tok_c]


@pytest.mark.parametrize("R,seed,max_delay,order", [
    (2, 11, 32, "lockstep"),
    (2, 12, 400, "two_in_flight"),
    (4, 101, 32, "combines_in_flight"),
    pytest.param(2, 16, 400, "combines_in_flight", marks=full),
    pytest.param(4, 17, 4000, "combines_in_flight", marks=full),
    pytest.param(4, 13, 32, "two_in_flight", marks=full),
    pytest.param(4, 14, 4000, "lockstep", marks=full),
    pytest.param(2, 15, 4000, "two_in_flight", marks=full),
])
def test_internode_ll_halves_in_one_run(R, seed, max_delay, order):
    """A first round half by half, then four rounds of dispatch and combine with every
    half in one run over the emulated NVSHMEM: receive halves wait on headers and count
    signals while their peers' send halves still stage and put (with long transport
    delays, puts of the next round queue behind this round's), sends reuse a parity only
    after its credit. Every round's handle and combined rows bit-exact below the counts,
    every send half hands over the epoch its receive half was given."""
    S, H, K, E, M = 4, 8, 2, 2 * R, 4
    em = internode_setup(R, S, H, K, E, M, "bf16", seed, max_delay=max_delay,
                         **_preempt(order))
    rng = np.random.default_rng(seed)
    rpd = M * min(K, E // R)
    first = internode_inputs(R, S, H, K, E, M, "bf16", rng)
    tokens = _internode_first_round(em, *first, K=K,
                                    want=ll_reference(*first, E=E, M=M, rows_per_dest=rpd))
    rounds = [internode_inputs(R, S, H, K, E, M, "bf16", rng) for _ in range(_rounds(order))]
    if order == "combines_in_flight":
        rounds = _one_dispatch(rounds)
    wants = [ll_reference(*inp, E=E, M=M, rows_per_dest=rpd) for inp in rounds]
    got = internode_one_run(em, rounds, wants, tokens, K=K, order=order)
    for i, (g, want) in enumerate(zip(got, wants)):
        if "recv_count" in g:
            g, want = below_count(g), below_count(want)
        assert_same(g, want, _keys(g), f"seed {seed} {order} round {i}: ")
    assert em.ll_errors() == [""] * R
