"""The hierarchical internode mode's kernel sources on the emulated GPU (2 nodes x 2 and x 4
GPUs, 4 nodes x 2), through its own FFI handlers, bit-exact against the reference backend;
and the same kernels built with small rings (2-row chunks, 2 chunks per RDMA ring, 3-row
NVLink rings) so that a few tokens fill and wrap every ring.

The combine's credit rule: a source that credited a node's RDMA stream only at the end of
each token stalled (until the timeout) once one token's rows from a node spanned the ring:
2 x 4 with topk 4 and the small rings. The source now sums a token in pieces and credits
each finished chunk before it waits for the next (SourceRole).
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from internode_emu_util import InternodeEmu, bits, reference, routing  # noqa: E402
from test_internode_emu import DISPATCH_FIELDS  # noqa: E402

pytestmark = pytest.mark.emu
full = pytest.mark.emu_full
BF16 = np.dtype(ml_dtypes.bfloat16)


def round_trip(em, mode, x, idx, w, y, g, *, E, C, K):
    R = x.shape[0]
    ref = reference(x, idx, w, y, g, E=E, C=C)
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode=mode)
    assert errs == [""] * R, errs
    assert em.errors() == [""] * R, em.errors()
    for r in range(R):
        for k in DISPATCH_FIELDS:
            want = ref[k][r].reshape(np.shape(outs[r][k]))
            assert (bits(outs[r][k]) == bits(want)).all(), f"rank {r} {k}"
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    src_index = np.stack([o["src_index"] for o in outs])
    out, errs = em.combine(y, counts, slot, topk=K, src_index=src_index, mode=mode)
    assert errs == [""] * R, errs
    assert em.errors() == [""] * R, em.errors()
    for r in range(R):
        assert (bits(out[r]) == bits(ref["out"][r])).all(), f"combine rank {r}"
    got, errs = em.gather(g, counts, slot, capacity=C, topk=K, mode=mode)
    assert errs == [""] * R and em.errors() == [""] * R
    for r in range(R):
        assert (bits(got[r]) == bits(ref["gather"][r])).all(), f"gather rank {r}"


def data(rng, R, T, H, K, E, C, dtype, kind="uniform"):
    x = rng.standard_normal((R, T, H)).astype(dtype)
    idx = routing(rng, R, T, K, E, kind)
    w = rng.random((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, C, H)).astype(dtype)
    g = rng.standard_normal((R, T, H)).astype(dtype)
    return x, idx, w, y, g


SHAPES = [  # (nodes, gpus per node, T, H, K, dtype, kind)
    (2, 2, 6, 8, 2, np.float32, "uniform"),
    pytest.param((2, 4, 5, 7, 3, BF16, "skewed"), marks=full),
    pytest.param((4, 2, 4, 6, 2, np.float16, "uniform"), marks=full),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hierarchical_matches_reference(shape):
    N, G, T, H, K, dtype, kind = shape
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=N * 10 + G)
    rng = np.random.default_rng(R + T)
    round_trip(em, "hierarchical", *data(rng, R, T, H, K, E, C, dtype, kind), E=E, C=C, K=K)


@pytest.mark.parametrize("N,G,K", [(2, 4, 4), pytest.param(2, 2, 2, marks=full)])
def test_small_rings_wrap_and_credit_per_chunk(N, G, K):
    """Small rings: every RDMA and NVLink ring wraps at least three times in each call,
    over three consecutive calls; with topk 4 at 2 x 4 one token has four rows from a node,
    more than the two-chunk ring holds past one chunk."""
    R = N * G
    T, H, E = 12, 4, 2 * R
    C = R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=7)
    rng = np.random.default_rng(3)
    el = E // R
    for _ in range(3):
        x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
        # every token to K or K - 1 ranks of the next node (one expert each): a stream
        # carries up to K rows per token, starting anywhere in a chunk (T * K / 4 turns
        # of the 4-row ring)
        for r in range(R):
            m = (r // G + 1) % N
            for t in range(T):
                ranks = m * G + rng.permutation(G)[:K]
                idx[r, t] = ranks * el + rng.integers(el, size=K)
                if rng.random() < 0.5:
                    idx[r, t, K - 1] = -1
        round_trip(em, "hierarchical_small_rings", x, idx, w, y, g, E=E, C=C, K=K)


@full
def test_hierarchical_skip_fails_every_rank():
    R, G, T, H, K = 4, 2, 4, 4, 2
    E, C = 8, 16
    em = InternodeEmu(R, gpus_per_node=G)
    rng = np.random.default_rng(1)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
    outs, _ = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical",
                          skip=(3,))
    recorded = em.errors()
    for r in (0, 1, 2):
        assert recorded[r], f"rank {r} recorded nothing"
        assert np.isnan(outs[r]["recv_x"]).all() and (outs[r]["counts"] == -1).all()
        assert int(outs[r]["num_recv"]) == -1
