"""Capacity boundaries on the emulated GPU, every output and handle field checked.

A receiving rank whose incoming rows number exactly the capacity C keeps them all; one with
C + 1 keeps the first C in (source, token) order and drops the last. An off-by-one in a
bound (a row at C - 1 dropped, a row at C written, a drop counted twice) shows in one of
recv_x, recv_idx, recv_w, num_recv, num_dropped, the per-expert counts, src_rank,
src_index or the send rows, and in combine and gather. Intranode dispatch, the internode
direct and hierarchical modes (their capacity), and the low-latency dispatch at its own
bound: M tokens of every source on one expert (a full block of R * M rows, and
M * min(K, E_local) combine rows per destination, the rows_per_dest bound).

The hand case (HAND_*) states its expectation literally, worked out from the routing; the
other cases compare with the reference backend; both compare every field.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from jax_ep._src.emu import Emulator  # noqa: E402

from emu_intranode_util import (DISPATCH_KEYS, LL_DISPATCH_KEYS, assert_same,  # noqa: E402
                                ll_reference, reference, rows, run_intranode)
from internode_emu_util import InternodeEmu  # noqa: E402
from internode_emu_util import reference as internode_reference  # noqa: E402
from test_internode_hier_emu import reference_in_nodes  # noqa: E402
from test_internode_ll_emu import below_count  # noqa: E402
from test_internode_ll_emu import setup as internode_ll_setup  # noqa: E402
from test_low_latency_emu import _setup as ll_setup  # noqa: E402
from test_low_latency_emu import assert_ll_same  # noqa: E402

pytestmark = pytest.mark.emu
full = pytest.mark.emu_full

# ------------------------------------------------------------------- the hand case
# R = 4 ranks, E = 8 experts (rank r owns 2r, 2r + 1), T = 2, K = 2, C = 3. Receivers
# take rows in (source, token) order:
#   rank 0: (0,0) (1,0) (2,1)            -> exactly C
#   rank 1: (0,0) (0,1) (2,0) | (3,0)    -> C + 1, (3,0) dropped
#   rank 2: (2,0) (2,1)                  rank 3: (1,1) (3,1)
# Ranks 0, 1 and 2, 3 are the two nodes of the hierarchical mode: rank 1's kept row from
# rank 2 and its dropped row from rank 3 cross nodes.
HAND_R, HAND_E, HAND_C = 4, 8, 3
HAND_IDX = np.array([[[0, 3], [2, -1]],
                     [[1, -1], [6, 7]],
                     [[3, 4], [0, 5]],
                     [[-1, 2], [7, -1]]], np.int32)
HAND_KEPT = [[(0, 0), (1, 0), (2, 1)], [(0, 0), (0, 1), (2, 0)], [(2, 0), (2, 1)],
             [(1, 1), (3, 1)]]
HAND = dict(
    num_recv=np.array([3, 3, 2, 2], np.int32),
    num_dropped=np.array([0, 1, 0, 0], np.int32),
    per_expert=np.array([[2, 1], [1, 2], [1, 1], [1, 2]], np.int32),
    src_rank=np.array([[0, 1, 2], [0, 0, 2], [2, 2, -1], [1, 3, -1]], np.int32),
    src_index=np.array([[0, 0, 1], [0, 1, 0], [0, 1, -1], [1, 1, -1]], np.int32),
    recv_idx=np.array([[[0, -1], [1, -1], [0, -1]],
                       [[-1, 1], [0, -1], [1, -1]],
                       [[-1, 0], [-1, 1], [-1, -1]],
                       [[0, 1], [1, -1], [-1, -1]]], np.int32),
    send_row=np.array([[[0, 0, -1, -1], [-1, 1, -1, -1]],
                       [[1, -1, -1, -1], [-1, -1, -1, 0]],
                       [[-1, 2, 0, -1], [2, -1, 1, -1]],
                       [[-1, -1, -1, -1], [-1, -1, -1, 1]]], np.int32),
)
# The internode handle: rows each source sends each receiver (before the cut at C), the
# same matrix on every rank, and each token's place among its source's rows to a receiver.
HAND_COUNTS = np.array([[1, 2, 0, 0], [1, 0, 0, 1], [1, 1, 2, 0], [0, 1, 0, 1]], np.int32)
HAND_SEND_SLOT = np.array([[[0, 0, -1, -1], [-1, 1, -1, -1]],
                           [[0, -1, -1, -1], [-1, -1, -1, 0]],
                           [[-1, 0, 0, -1], [0, -1, 1, -1]],
                           [[-1, 0, -1, -1], [-1, -1, -1, 0]]], np.int32)


def hand_data(rng, dtype=np.float32, H=8):
    R, T, K, C = HAND_R, 2, 2, HAND_C
    x = rng.standard_normal((R, T, H)).astype(dtype)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, C, H)).astype(dtype)
    g = rng.standard_normal((R, T, H)).astype(dtype)
    return x, HAND_IDX.copy(), w, y, g


def hand_expectation(x, w, y, g):
    """The fields of HAND plus the rows they select: recv_x, recv_w (the weight of each
    kept local slot), combine's out (float32 sum over receivers, ascending, one or two
    rows per token: exact in float32) and gather's rows."""
    R, T, H = x.shape
    C = HAND_C
    want = {k: v.copy() for k, v in HAND.items()}
    want["recv_x"] = np.zeros((R, C, H), x.dtype)
    want["recv_w"] = np.zeros((R, C, 2), np.float32)
    want["gather"] = np.zeros((R, C, H), g.dtype)
    for r, kept in enumerate(HAND_KEPT):
        for i, (s, t) in enumerate(kept):
            want["recv_x"][r, i] = x[s, t]
            want["recv_w"][r, i] = np.where(HAND["recv_idx"][r, i] >= 0, w[s, t], 0)
            want["gather"][r, i] = g[s, t]
    out = np.zeros((R, T, H), np.float32)
    for s in range(R):
        for t in range(T):
            for r in range(R):
                row = HAND["send_row"][s, t, r]
                if row >= 0:
                    out[s, t] += y[r, row].astype(np.float32)
    want["out"] = out.astype(y.dtype)
    return want


ALL_INTRANODE = DISPATCH_KEYS + ("out", "gather")


def test_hand_case_is_what_the_reference_backend_says():
    """The literal expectation agrees with the reference backend, field for field (so
    a mistake in either shows here, not as a kernel failure)."""
    x, idx, w, y, g = hand_data(np.random.default_rng(0))
    want = hand_expectation(x, w, y, g)
    ref = reference(x, idx, w, y, g, E=HAND_E, C=HAND_C)
    assert_same(ref, want, ALL_INTRANODE, "reference vs hand: ")


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=full), pytest.param(3, marks=full)])
def test_intranode_hand_case_exact_and_one_over(seed):
    """Intranode dispatch, combine and gather on the hand case: rank 0 receives exactly
    C rows, rank 1 C + 1 (its last, from rank 3, dropped); every field equals the literal
    expectation and the reference backend."""
    x, idx, w, y, g = hand_data(np.random.default_rng(seed))
    emu = Emulator(HAND_R, seed=seed, resident_blocks=2)
    emu.setup(tokens=2, capacity=HAND_C, row_bytes=x.shape[2] * 4, topk=2)
    got = run_intranode(emu, x, idx, w, y, g, E=HAND_E, C=HAND_C)
    assert_same(got, hand_expectation(x, w, y, g), ALL_INTRANODE, f"seed {seed} hand: ")
    ref = reference(x, idx, w, y, g, E=HAND_E, C=HAND_C)
    assert_same(got, ref, ALL_INTRANODE, f"seed {seed} reference: ")
    assert emu.check_errors() == []


def boundary_routing(rng, R, T, K, E):
    """Random routing (distinct experts per token, some slots -1) drawn until two ranks'
    incoming rows differ by exactly one: returns (idx, C, exact, over) with C the smaller
    count, rank `exact` receiving C rows and rank `over` C + 1."""
    el = E // R
    while True:
        idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                        for _ in range(R)]).astype(np.int32)
        idx = np.where(rng.random(idx.shape) < 0.2, -1, idx).astype(np.int32)
        owner = np.where(idx >= 0, idx // el, -1)
        incoming = np.array([(owner == r).any(axis=2).sum() for r in range(R)])
        for a in range(R):
            for b in range(R):
                if incoming[b] == incoming[a] + 1 and incoming[a] >= 2:
                    return idx, int(incoming[a]), a, b


@pytest.mark.parametrize("R,T,K,dtype,seed", [
    (4, 6, 3, "bf16", 11),
    pytest.param(2, 5, 2, "f16", 12, marks=full),
    pytest.param(8, 3, 4, "f32", 13, marks=full),
    pytest.param(4, 8, 2, "bf16", 14, marks=full),
])
def test_intranode_random_exact_and_one_over(R, T, K, dtype, seed):
    """Random routing with one rank receiving exactly C rows and another C + 1, two
    resident blocks: every dispatch, combine and gather field equals the reference."""
    rng = np.random.default_rng(seed)
    E, H = 2 * R, 16
    idx, C, exact, over = boundary_routing(rng, R, T, K, E)
    x = rows(dtype, (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rows(dtype, (R, C, H), rng)
    g = rows(dtype, (R, T, H), rng)
    ref = reference(x, idx, w, y, g, E=E, C=C)
    assert ref["num_recv"][exact] == C and ref["num_dropped"][exact] == 0
    assert ref["num_recv"][over] == C and ref["num_dropped"][over] == 1
    emu = Emulator(R, seed=seed, resident_blocks=2)
    emu.setup(tokens=T, capacity=C, row_bytes=x[0, 0].nbytes, topk=K)
    got = run_intranode(emu, x, idx, w, y, g, E=E, C=C)
    assert_same(got, ref, ALL_INTRANODE, f"seed {seed} (C={C}, exact {exact}, over {over}): ")
    assert emu.check_errors() == []


# ------------------------------------------------------------------ internode modes

INTERNODE_FIELDS = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                    "src_rank", "src_index")


def internode_round(em, mode, x, idx, w, y, g, *, E, C, K, want):
    """dispatch, combine and gather of one mode, every field against `want` (a dict with
    a leading rank axis, send_row the contract's); the handle's counts and send_slot must
    give send_row (the receiver's base row plus the slot, cut at C)."""
    R = x.shape[0]
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode=mode)
    assert errs == [""] * R, errs
    got = {k: np.stack([o[k] for o in outs]) for k in INTERNODE_FIELDS + ("counts", "send_slot")}
    assert_same(got, want, INTERNODE_FIELDS, f"{mode} dispatch: ")
    counts, slot = got["counts"], got["send_slot"]
    assert (counts == counts[0]).all(), counts
    base = np.cumsum(counts[0], axis=0) - counts[0]  # rows of earlier sources, per receiver
    row = base[np.arange(R)][:, None, :] + slot
    send_row = np.where((slot >= 0) & (row < C), row, -1)
    assert_same({"send_row": send_row}, want, ("send_row",), f"{mode} handle: ")
    out, errs = em.combine(y, counts, slot, topk=K, mode=mode,
                           src_index=got["src_index"] if mode != "direct" else None)
    assert errs == [""] * R, errs
    assert_same({"out": np.stack(out)}, want, ("out",), f"{mode} combine: ")
    gat, errs = em.gather(g, counts, slot, capacity=C, topk=K, mode=mode)
    assert errs == [""] * R, errs
    assert_same({"gather": np.stack(gat)}, want, ("gather",), f"{mode} gather: ")
    assert em.errors() == [""] * R
    return got


@pytest.mark.parametrize("mode,G,seed", [
    ("direct", 1, 21), ("hierarchical", 2, 22),
    pytest.param("direct", 1, 23, marks=full), pytest.param("hierarchical", 2, 24, marks=full),
])
def test_internode_hand_case_exact_and_one_over(mode, G, seed):
    """The hand case through the internode direct mode (4 nodes of one GPU) and the
    hierarchical mode (2 nodes of 2): rank 1's row past C comes from the other node and
    is never sent on; the count matrix and send slots are the literal ones, and every
    field, combine and gather equal the literal expectation and the reference."""
    x, idx, w, y, g = hand_data(np.random.default_rng(seed))
    want = hand_expectation(x, w, y, g)
    em = InternodeEmu(HAND_R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=seed)
    got = internode_round(em, mode, x, idx, w, y, g, E=HAND_E, C=HAND_C, K=2, want=want)
    assert (got["counts"] == HAND_COUNTS[None]).all(), got["counts"][0]
    assert_same(got, {"send_slot": HAND_SEND_SLOT}, ("send_slot",), f"{mode}: ")
    ref = (internode_reference(x, idx, w, y, g, E=HAND_E, C=HAND_C, G=G) if mode == "direct"
           else reference_in_nodes(G, x, idx, w, y, g, E=HAND_E, C=HAND_C))
    assert_same(want, ref, ALL_INTRANODE, f"{mode} reference vs hand: ")


@pytest.mark.parametrize("mode,R,G,T,K,seed", [
    ("direct", 4, 1, 6, 3, 31),
    ("hierarchical", 4, 2, 6, 2, 32),
    pytest.param("direct", 8, 1, 4, 3, 33, marks=full),
    pytest.param("hierarchical", 8, 4, 5, 3, 34, marks=full),
])
def test_internode_random_exact_and_one_over(mode, R, G, T, K, seed):
    """Random routing with one rank at exactly C incoming rows and one at C + 1 (bf16
    rows), through the internode mode: every field, combine and gather equal the
    reference (summing in the run's nodes)."""
    rng = np.random.default_rng(seed)
    E, H = 2 * R, 8
    idx, C, exact, over = boundary_routing(rng, R, T, K, E)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rows("bf16", (R, C, H), rng)
    g = rows("bf16", (R, T, H), rng)
    ref = (internode_reference(x, idx, w, y, g, E=E, C=C, G=G) if mode == "direct"
           else reference_in_nodes(G, x, idx, w, y, g, E=E, C=C))
    assert ref["num_recv"][exact] == C and ref["num_dropped"][over] == 1
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=seed)
    internode_round(em, mode, x, idx, w, y, g, E=E, C=C, K=K, want=ref)


# ------------------------------------------------------------------ low latency
# R = 2, E = 4 (rank 1 owns experts 2, 3), K = 2, S = M = 3: every token of rank 0 picks
# experts 2 and 3, every token of rank 1 experts 2 and 0. Expert 2 fills its whole block
# (R * M rows: M from each source), rank 0 sends rank 1 M * min(K, E_local) = 6 combine
# rows back (rows_per_dest exactly), and each (expert, source) pair that has rows has M.
LL_R, LL_E, LL_K, LL_M = 2, 4, 2, 3
LL_IDX = np.array([[[2, 3]] * LL_M, [[2, 0]] * LL_M], np.int32)


def ll_hand_expectation(x):
    M = LL_M
    ar, none = list(range(M)), [-1] * M
    want = dict(
        recv_count=np.array([[M, 0], [2 * M, M]], np.int32),
        row_count=np.array([[[0, M], [0, 0]], [[M, M], [M, 0]]], np.int32),
        first_row=np.array([[[0, 0], [0, 0]], [[0, M], [0, M]]], np.int32),
        src_rank=np.array([[[1] * M + none, none + none], [[0] * M + [1] * M, [0] * M + none]],
                          np.int32),
        src_index=np.array([[ar + none, none + none], [ar + ar, ar + none]], np.int32),
    )
    rx = np.zeros((LL_R, 2, LL_R * M, x.shape[2]), x.dtype)
    rx[0, 0, :M] = x[1]
    rx[1, 0, :M], rx[1, 0, M:] = x[0], x[1]
    rx[1, 1, :M] = x[0]
    want["recv_x"] = rx
    return want


def ll_data(rng, dtype, H=16):
    x = rows(dtype, (LL_R, LL_M, H), rng)
    w = rng.standard_normal((LL_R, LL_M, LL_K)).astype(np.float32)
    y = rows(dtype, (LL_R, LL_E // LL_R, LL_R * LL_M, H), rng)
    return x, LL_IDX.copy(), w, y


@pytest.mark.parametrize("seed", [41, pytest.param(42, marks=full)])
def test_ll_full_block_and_rows_per_dest(seed):
    """Intranode low latency at M tokens on one expert from every source (two rounds,
    both halves of the area, two resident blocks): recv_x, recv_count, src_rank,
    src_index, first_row and row_count equal the literal expectation and the reference;
    the combine, whose send half sends exactly rows_per_dest rows to rank 0, equals the
    reference."""
    rng = np.random.default_rng(seed)
    rpd = LL_M * min(LL_K, LL_E // LL_R)
    emu = ll_setup(LL_R, LL_M, 16, LL_K, LL_E, LL_M, "bf16", seed, resident_blocks=2)
    for rnd in range(2):
        x, idx, w, y = ll_data(rng, "bf16")
        want = ll_reference(x, idx, w, y, E=LL_E, M=LL_M, rows_per_dest=rpd)
        assert_ll_same(want, ll_hand_expectation(x), LL_DISPATCH_KEYS, "reference vs hand: ")
        s = emu.ll_dispatch_send(x, idx, num_experts=LL_E, max_tokens=LL_M)
        d = emu.ll_dispatch_recv(s, num_experts=LL_E, max_tokens=LL_M, H=16, dtype=x.dtype)
        assert_ll_same(d, ll_hand_expectation(x), LL_DISPATCH_KEYS, f"round {rnd} hand: ")
        c = emu.ll_combine_send(y, d["first_row"], d["row_count"], max_tokens=LL_M,
                                rows_per_dest=rpd)
        d["out"] = emu.ll_combine_recv(c, idx, w, num_experts=LL_E, max_tokens=LL_M)
        assert_ll_same(d, want, LL_DISPATCH_KEYS + ("out",), f"round {rnd} reference: ")
    assert emu.check_errors() == []


@pytest.mark.parametrize("seed", [43, pytest.param(44, marks=full)])
def test_internode_ll_full_block_and_rows_per_dest(seed):
    """The same boundary through the internode low-latency mode over the emulated
    NVSHMEM (two rounds, both parities): every dispatch field equals the literal
    expectation and the reference below the counts, combine equals the reference."""
    rng = np.random.default_rng(seed)
    H = 16
    rpd = LL_M * min(LL_K, LL_E // LL_R)
    em = internode_ll_setup(LL_R, LL_M, H, LL_K, LL_E, LL_M, "bf16", seed)
    for rnd in range(2):
        x, idx, w, y = ll_data(rng, "bf16", H)
        tok, errs = em.ll_dispatch_send(x, idx)
        assert errs == [""] * LL_R, errs
        d, errs = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
        assert errs == [""] * LL_R, errs
        got = {k: np.stack([o[k] for o in d]) for k in LL_DISPATCH_KEYS}
        assert_same(below_count(got), below_count(ll_hand_expectation(x)), LL_DISPATCH_KEYS,
                    f"round {rnd} hand: ")
        tok, errs = em.ll_combine_send(y, got["first_row"], got["row_count"], rows_per_dest=rpd)
        assert errs == [""] * LL_R, errs
        out, errs = em.ll_combine_recv(tok, idx, w, H=H, dtype=x.dtype)
        assert errs == [""] * LL_R, errs
        got["out"] = np.stack(out)
        want = ll_reference(x, idx, w, y, E=LL_E, M=LL_M, rows_per_dest=rpd)
        assert_same(below_count(got), below_count(want), LL_DISPATCH_KEYS + ("out",),
                    f"round {rnd} reference: ")
    assert em.ll_errors() == [""] * LL_R
