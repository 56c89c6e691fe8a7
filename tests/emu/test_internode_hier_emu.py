"""The hierarchical internode mode's kernel sources on the emulated GPU (2 nodes x 2 and x 4
GPUs, 4 nodes x 2), through its own FFI handlers, bit-exact against the reference backend
summing in the nodes of the run (kernels/common/combine_order.h: node partials rounded to
the row dtype, then nodes in ascending order); and the same kernels
built with small rings (2-row chunks, 2 chunks per RDMA ring, 3-row NVLink rings) so that a
few tokens fill and wrap every ring.

The combine reduced within the node: each forwarder sends one row per (token, node), the
node partial rounded to the row dtype, and the source adds the partials in node order; the
transport log shows the combine's inter-node rows equal the dispatch's.
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest

import jax_ep

from jax_ep._src import emu as emulator
from jax_ep.network.hier_layout import NVL_RING_ROWS, hier_layout

sys.path.insert(0, os.path.dirname(__file__))
from internode_emu_util import (SIGNAL_ADD, InternodeEmu, _reference_program,  # noqa: E402
                                bits, reference, routing)
from test_internode_emu import DISPATCH_FIELDS  # noqa: E402

pytestmark = [pytest.mark.emu, pytest.mark.usefixtures("transport")]
full = pytest.mark.emu_full
BF16 = np.dtype(ml_dtypes.bfloat16)


def reference_in_nodes(G, *args, **kw):
    """The reference backend (internode_emu_util.reference) summing combine in nodes of G
    ranks (JAX_EP_GPUS_PER_NODE, read when the program is traced; the util's program
    cache does not key on it, so it is cleared around the call)."""
    _reference_program.cache_clear()
    try:
        with jax_ep.config.override(gpus_per_node=G):
            return reference(*args, **kw)
    finally:
        _reference_program.cache_clear()


def round_trip(em, mode, x, idx, w, y, g, *, E, C, K, kind_differs=False):
    R = x.shape[0]
    ref = reference_in_nodes(em.G, x, idx, w, y, g, E=E, C=C)
    want_out = ref["out"]
    if em.G < R and K > 2 and kind_differs:
        # the data tells the node order from the rank order apart (with two rows per
        # token, or all of a token's rows on one node in float32, the orders coincide)
        one_node = reference_in_nodes(R, x, idx, w, y, E=E, C=C)["out"]
        assert (bits(want_out) != bits(one_node)).any()
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
        assert (bits(out[r]) == bits(want_out[r])).all(), f"combine rank {r}"
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
    round_trip(em, "hierarchical", *data(rng, R, T, H, K, E, C, dtype, kind), E=E, C=C, K=K,
               kind_differs=True)


@pytest.mark.parametrize("push_parts", [None, "1"])
def test_hierarchical_node_partials_rounded(push_parts, monkeypatch):
    """2 x 2, bfloat16, every token to every rank: each token has two rows on each node, so
    rounding both nodes' partials (the source's own included) to bfloat16 shows in the
    bits against summing in one node. The combine pushers as 4 parts (the default for
    rows of four 16-byte vectors) and as one (JAX_EP_HIER_PUSH_PARTS=1)."""
    if push_parts is None:
        jax_ep.config.update("hier_push_parts", None)
    else:
        jax_ep.config.update("hier_push_parts", push_parts)
    N, G, T, H, K = 2, 2, 8, 32, 4
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=6)
    rng = np.random.default_rng(31)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, BF16)
    el = E // R
    idx[:] = np.arange(R) * el + rng.integers(el, size=(R, T, K))
    round_trip(em, "hierarchical", x, idx, w, y, g, E=E, C=C, K=K, kind_differs=True)


def test_hierarchical_drops_past_capacity():
    """Capacity far below the rows sent (2 x 2, bfloat16, topk 3): the rows past C at a
    receiver are never forwarded, the handle and combine follow the kept rows only."""
    N, G, T, H, K = 2, 2, 8, 8, 3
    R = N * G
    E, C = 2 * R, 7
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=4)
    rng = np.random.default_rng(21)
    args = data(rng, R, T, H, K, E, C, BF16)
    assert int(reference_in_nodes(G, *args[:4], E=E, C=C)["num_dropped"].sum()) > 0
    round_trip(em, "hierarchical", *args, E=E, C=C, K=K)


@pytest.mark.parametrize("N,G,K", [(2, 4, 4), pytest.param(2, 2, 2, marks=full)])
def test_small_rings_wrap_and_credit_per_chunk(N, G, K):
    """Small rings: every RDMA and NVLink ring wraps at least three times in each call,
    over three consecutive calls; with topk 4 at 2 x 4 one token has four rows on a node,
    which its forwarder sums into one partial."""
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


@pytest.mark.parametrize("source_blocks", ["1", "3", "6"])
def test_small_rings_own_node_rows_fill_the_source_windows(source_blocks, monkeypatch):
    """Small rings, every token to K of its own node's ranks (or to K - 1 of them and one
    rank of the next node): the NVLink rings that bring the source its own node's rows (3
    slots) hold fewer rows than a window of 8 tokens asks for, and the 2 x 2-row RDMA
    stream fewer chunks, so the source's windows end at the rings' room; over three
    consecutive calls every ring wraps; with one, three and six source blocks for rows of
    four 16-byte vectors (six: two blocks sum nothing and still join every window). Rows
    of 64 bytes are copied by four lanes, so a release that does not cover the other lanes'
    stores shows. Blocks are preempted now and then (parked for 20 us of virtual time), so
    a block that frees a window's rows before the block summing them has read them shows."""
    jax_ep.config.update("hier_source_blocks", source_blocks)
    N, G, K = 2, 4, 4
    R = N * G
    T, H, E = 12, 16, 2 * R
    C = R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=13,
                      preempt_prob=0.002, preempt_ns=20000.0)
    rng = np.random.default_rng(17)
    el = E // R
    for _ in range(3):
        x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
        for r in range(R):
            me = r // G
            for t in range(T):
                ranks = me * G + rng.permutation(G)[:K]
                if rng.random() < 0.5:
                    ranks[K - 1] = ((me + 1) % N) * G + rng.integers(G)
                idx[r, t] = ranks * el + rng.integers(el, size=K)
        round_trip(em, "hierarchical_small_rings", x, idx, w, y, g, E=E, C=C, K=K)


@pytest.mark.parametrize(
    "qpp,dispatch_blocks,combine_blocks,blocks,role_blocks,push_parts,fwd_columns",
    [(1, None, None, 12, 8, None, "4"), (2, "3", "2", 6, 5, None, "4"),
     (2, "3", "2", 3, 2, "1", None)])
def test_small_rings_role_parts_over_blocks(qpp, dispatch_blocks, combine_blocks, blocks,
                                            role_blocks, push_parts, fwd_columns,
                                            monkeypatch):
    """Small rings, every token to K ranks of the next node. The dispatch's sender to a node
    runs as parts that each own the chunks of some QPs (2 parts with 2 QPs, 4 with 4), its
    local and rail forwarders as 4 parts that each own one receiver of the node, each of
    them (JAX_EP_HIER_FORWARD_COLUMNS=4; one by default) as 4 column parts that copy one
    16-byte vector of every row (column part 0 releases a ring's tail only once every
    column part has marked its rows written), and part 0 credits a chunk only once every
    part is done with it. The combine's forwarder runs as 4 parts
    that each sum a slice of the columns (rows of four 16-byte vectors), and part 0 frees
    a chunk's ring rows and puts the chunk only once every part has written it; each
    pusher runs as 4 parts that each copy one 16-byte vector of every row, and part 0
    releases a batch only once every part has written it. The role warps spread over the
    hierarchical mode's 12 SMs at 8 ranks (configs.h kInternodeSmPresets; dispatch 12;
    combine 4 source blocks, one per vector, and the 8 role blocks left), or packed into
    the fewest that
    JAX_EP_HIER_DISPATCH_BLOCKS / _COMBINE_BLOCKS ask for (6 for the dispatch's 44
    warps, 3 for its 20 with the default of one column part per forwarder part, where one
    warp copies each row whole; 5 for the
    combine's 36, below the 2 asked; 2 for its 12 with one part a pusher,
    JAX_EP_HIER_PUSH_PARTS=1, where each pusher's lanes share every row). Blocks are
    preempted now and then, so a part that lags behind part 0 shows. Bit-exact over three
    calls, and the launches have that many blocks."""
    jax_ep.config.update("hier_dispatch_blocks", dispatch_blocks)
    jax_ep.config.update("hier_combine_blocks", combine_blocks)
    jax_ep.config.update("hier_push_parts", push_parts)
    jax_ep.config.update("hier_forward_columns", fwd_columns)
    jax_ep.config.update("hier_source_blocks", None)
    N, G, K = 2, 4, 3
    R = N * G
    T, H, E = 12, 16, 2 * R
    C = R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=qpp, seed=29,
                      preempt_prob=0.002, preempt_ns=20000.0)
    rng = np.random.default_rng(31)
    el = E // R
    em.emu.reset_counters()
    for _ in range(3):
        x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
        for r in range(R):
            m = (r // G + 1) % N
            for t in range(T):
                idx[r, t] = (m * G + rng.permutation(G)[:K]) * el + rng.integers(el, size=K)
        round_trip(em, "hierarchical_small_rings", x, idx, w, y, g, E=E, C=C, K=K)
    c = em.emu.counters()
    got = {k: v for k, v in c.items() if k.startswith("kernel:DispatchMain")}
    assert got.get("kernel:DispatchMain:blocks") == 6 * R * blocks, got  # dispatch, gather
    launched = sum(v for k, v in c.items()
                   if k.startswith("kernel:CombineMain") and k.endswith(":blocks"))
    assert launched == 3 * R * (4 + role_blocks), launched


@pytest.mark.parametrize("source_blocks,blocks,role_blocks", [(None, 6, 6), ("3", 3, 9)])
def test_combine_source_blocks_split_the_columns(source_blocks, blocks, role_blocks,
                                                 monkeypatch):
    """The combine's source runs as several blocks, each summing a slice of the columns: 6
    by default for rows of 8 16-byte vectors (H = 64 bf16: half the hierarchical mode's 12
    SMs at 4 ranks, configs.h HierCombineFit), 3 (uneven slices) when
    JAX_EP_HIER_SOURCE_BLOCKS asks; bit-exact either way, and the launch has that many
    source blocks beside the role blocks: the rest of the 12 (6 beside 6 source blocks, 9
    beside 3), which hold the role warps (8 forwarder parts, one per vector, and 4 pushers
    of 4 parts: 24)."""
    if source_blocks is not None:
        jax_ep.config.update("hier_source_blocks", source_blocks)
    else:
        jax_ep.config.update("hier_source_blocks", None)
    jax_ep.config.update("hier_combine_blocks", None)
    N, G, T, H, K = 2, 2, 6, 64, 3
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, seed=21)
    rng = np.random.default_rng(23)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, BF16)
    em.emu.reset_counters()
    round_trip(em, "hierarchical", x, idx, w, y, g, E=E, C=C, K=K)
    c = em.emu.counters()
    launched = {k: v for k, v in c.items() if k.startswith("kernel:CombineMain")}
    got = sum(v for k, v in launched.items() if k.endswith(":blocks"))
    assert got == R * (blocks + role_blocks), launched


@pytest.mark.parametrize("sms", [2, 5])
def test_hierarchical_sms_budget(sms):
    """JAX_EP_HIERARCHICAL_SMS: 2 x 2, rows of two 16-byte vectors. The dispatch and gather
    run on that many blocks (10 role warps fit in 2), the combine's source and role blocks
    split it (configs.h HierCombineFit: 1 + 1 or 2 + 3, the pusher and forwarder parts
    shrunk to fit); bit-exact against the reference either way."""
    N, G, T, H, K = 2, 2, 6, 8, 2
    R = N * G
    E, C = 2 * R, R * T
    for name in ("hier_source_blocks", "hier_combine_blocks", "hier_dispatch_blocks",
                 "hier_push_parts", "hier_forward_columns"):
        jax_ep.config.update(name, None)
    with jax_ep.config.override(hierarchical_sms=sms):
        em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=17)
        assert em.emu.m.mode_sms(R)["hierarchical"] == sms
        rng = np.random.default_rng(13)
        em.emu.reset_counters()
        round_trip(em, "hierarchical", *data(rng, R, T, H, K, E, C, np.float32), E=E, C=C,
                   K=K)
        c = em.emu.counters()
    for kernel in ("DispatchMain", "CombineMain"):
        blocks = sum(v for k, v in c.items()
                     if k.startswith(f"kernel:{kernel}") and k.endswith(":blocks"))
        launches = sum(v for k, v in c.items()
                       if k.startswith(f"kernel:{kernel}") and k.endswith(":launches"))
        assert launches > 0 and blocks == launches * sms, (kernel, blocks, launches)


def test_hierarchical_sms_below_the_roles_is_refused():
    """A hierarchical_sms below the blocks the dispatch's role warps need (2 here) fails the
    call on every rank with an error naming the setting and its variable, before anything
    is launched: the next call with the budget back runs bit-exact."""
    N, G, T, H, K = 2, 2, 4, 8, 2
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=3)
    rng = np.random.default_rng(4)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
    with jax_ep.config.override(hierarchical_sms=1):
        _, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    for r in range(R):
        assert "hierarchical_sms (JAX_EP_HIERARCHICAL_SMS) = 1" in errs[r], (r, errs[r])
    round_trip(em, "hierarchical", x, idx, w, y, g, E=E, C=C, K=K)


def test_cooperative_kernels_take_their_ptxas_residency():
    """The cooperative DispatchMain and CombineMain launch under their own names, so on the
    default co-residency (resident_blocks=None: 132 SMs and the kernel's ptxas row) their
    grids are checked against their occupancy-table limits, not the fallback for a kernel
    the table lacks; the counters name them."""
    N, G, T, H, K = 2, 2, 4, 8, 2
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, seed=9, resident_blocks=None)
    m = em.emu.m
    rng = np.random.default_rng(5)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
    em.emu.reset_counters()
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R, errs
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    src_index = np.stack([o["src_index"] for o in outs])
    _, errs = em.combine(y, counts, slot, topk=K, src_index=src_index, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R, errs
    c = em.emu.counters()
    assert c.get("kernel:DispatchMain:launches") == R, sorted(k for k in c if "launches" in k)
    assert sum(v for k, v in c.items()
               if k.startswith("kernel:CombineMain") and k.endswith(":launches")) == R
    fallbacks = set(m.occupancy_fallbacks())
    assert not fallbacks & {"cudaLaunchKernelEx", "DispatchMain", "CombineMain"}, fallbacks
    assert m.resident_limit("DispatchMain", 256) != m.resident_limit("KernelNotInTheTable", 256)


def test_cooperative_launch_past_the_residency_limit_is_refused():
    """2 x 4: DispatchMain's cooperative grid is at least 3 blocks (18 role warps); with one block
    resident per GPU every rank's launch is refused, as cudaLaunchKernelEx refuses a
    cooperative grid larger than the device holds (cudaErrorCooperativeLaunchTooLarge),
    and no rank hangs on a block that could never run."""
    N, G, T, H, K = 2, 4, 4, 8, 2
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, seed=2, resident_blocks=1)
    rng = np.random.default_rng(8)
    x, idx, w, _, _ = data(rng, R, T, H, K, E, C, np.float32)
    _, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    for r in range(R):
        assert "cooperative launch" in errs[r] and "too many blocks" in errs[r], (r, errs[r])


def test_combine_inter_node_bytes_equal_dispatch():
    """The emulated transport log of one dispatch and its combine on the same routing (2 x 4,
    topk 4, no capacity drops): the data puts between nodes carry as many rows in the
    combine as in the dispatch, one per (token, other node with a receiver), and fewer than
    the (token, remote receiver) rows a combine without the in-node sum sends. Counted:
    put-with-signal ADD records (ring chunks) whose source and destination are on different
    nodes, in rows (bytes / the ring row stride, one stride for both directions) and in
    payload bytes (rows x H x itemsize). Excluded: the count exchange and call headers (SET
    signals on QP 0), credits and closing signals (signals without data), the metadata inside
    each row (dispatch ids and weights, the token/rank words) and the padding to the stride."""
    N, G, T, H, K = 2, 4, 10, 16, 4
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=5)
    rng = np.random.default_rng(11)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, BF16)
    em.log()  # the set-up's records
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R
    log_d, pending = em.log()
    assert pending == 0
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    src_index = np.stack([o["src_index"] for o in outs])
    _, errs = em.combine(y, counts, slot, topk=K, src_index=src_index, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R
    log_c, pending = em.log()
    assert pending == 0
    stride = hier_layout(R, G, 2, H, K, BF16.itemsize, BF16.itemsize).row_stride

    def inter_node_rows(log):
        data_puts = [r for r in log if r["sig_op"] == SIGNAL_ADD and r["bytes"] > 0
                     and r["src"] // G != r["dst"] // G]
        total = sum(r["bytes"] for r in data_puts)
        assert data_puts and total % stride == 0
        return total // stride

    el = E // R
    owner = np.where(idx >= 0, idx // el, -1)  # [R, T, K] receiving rank
    pairs = receivers = 0
    for s in range(R):
        for t in range(T):
            dests = {int(d) for d in owner[s, t] if d >= 0 and d // G != s // G}
            pairs += len({d // G for d in dests})
            receivers += len(dests)
    assert receivers > pairs, "the routing has tokens with several receivers on a node"
    rows_d, rows_c = inter_node_rows(log_d), inter_node_rows(log_c)
    assert rows_d == pairs
    assert rows_c == rows_d, (f"payload bytes between nodes: dispatch {rows_d * H * 2}, "
                              f"combine {rows_c * H * 2}")


def test_combine_pushers_write_half_a_ring_per_release(transport):
    """The shipped rings filled: 2 x 2, float32, 200 tokens, topk 4 of 8 experts, so every
    source's rows at a rank (about 160) wrap its 64-row NVLink ring twice. Bit-exact against
    the reference; and each combine pusher (one per source up to 64 ranks, each of its
    parts a warp that fences once per batch) publishes a source's rows in batches of half
    a ring, however far its reader lags: the longest chain of system fences over a rank's
    threads (pushers are the combine's only system-fence writers) is ceil(rows / (ring /
    2)) for the source with the most rows there."""
    N, G, T, H, K = 2, 2, 200, 8, 4
    R = N * G
    E, C = 2 * R, R * T
    em = InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=3, heap_mib=16)
    rng = np.random.default_rng(41)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
    ref = reference_in_nodes(G, x, idx, w, y, g, E=E, C=C)
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R, errs
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    src_index = np.stack([o["src_index"] for o in outs])
    emulator.reset_counters()
    out, errs = em.combine(y, counts, slot, topk=K, src_index=src_index, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R, errs
    half = NVL_RING_ROWS // 2
    for r in range(R):
        assert (bits(out[r]) == bits(ref["out"][r])).all(), f"combine rank {r}"
        src = np.asarray(outs[r]["src_rank"]).ravel()
        rows = np.bincount(src[src >= 0], minlength=R)
        assert rows.min() > 2 * NVL_RING_ROWS, rows  # every ring wraps twice
        batches = int(-(-rows.max() // half))
        chain = emulator.counters(r).get("chain:fences:system", 0)
        if transport == "nvshmem":
            assert chain == batches, (r, rows)
        else:  # the count exchange's copies to this node's peers fence too (LSA puts)
            assert batches <= chain <= batches + 2, (r, rows, chain)


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


@full
def test_hierarchical_combine_skip_fails_every_rank():
    """A rank that skips the combine (after a good dispatch): every other rank's combine
    ends in a recorded error (a timeout on the NVLink ring, an RDMA stream or the call
    header) and NaN outputs, never plausible sums."""
    R, G, T, H, K = 4, 2, 4, 4, 2
    E, C = 8, 16
    em = InternodeEmu(R, gpus_per_node=G)
    rng = np.random.default_rng(2)
    x, idx, w, y, g = data(rng, R, T, H, K, E, C, np.float32)
    outs, errs = em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical")
    assert errs == [""] * R and em.errors() == [""] * R
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    src_index = np.stack([o["src_index"] for o in outs])
    out, _ = em.combine(y, counts, slot, topk=K, src_index=src_index, mode="hierarchical",
                        skip=(1,))
    recorded = em.errors()
    for r in (0, 2, 3):
        assert recorded[r], f"rank {r} recorded nothing"
        assert np.isnan(out[r]).all(), f"rank {r} wrote plausible sums"
