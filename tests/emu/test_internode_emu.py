"""The internode (NVSHMEM) direct mode's kernel sources on the emulated GPU, through its
own FFI handlers, bit-exact against the reference backend; its failure outputs, faults
ending in errors on every rank, and the transport log against the striping plan.

The cases marked emu_full are the larger ones (`-m "not emu_full"` leaves them out of a
quick run); `make test` and `make test-emu` run them all.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from internode_emu_util import (SIGNAL_ADD, SIGNAL_SET, InternodeEmu, bits,  # noqa: E402
                                reference, routing)

from jax_ep.network.plan import check_wire_log  # noqa: E402
from jax_ep.network.transport import TransportConfig  # noqa: E402

SYSFS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "sysfs")
pytestmark = [pytest.mark.emu, pytest.mark.usefixtures("transport")]
full = pytest.mark.emu_full
BF16 = np.dtype(ml_dtypes.bfloat16)
DISPATCH_FIELDS = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                   "src_rank", "src_index")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    R: int = 4
    T: int = 6
    H: int = 8
    K: int = 2
    E: int = 8
    C: int = 24
    dtype: object = np.float32
    kind: str = "uniform"
    chunk: int = 64
    ports: int = 2
    qpp: int = 1
    seed: int = 0
    G: int = 1  # GPUs per emulated node (combine's order has R / G nodes)


def inputs(c: Case, rng=None):
    rng = rng or np.random.default_rng(c.seed)
    x = rng.standard_normal((c.R, c.T, c.H)).astype(c.dtype)
    idx = routing(rng, c.R, c.T, c.K, c.E, c.kind)
    w = rng.random((c.R, c.T, c.K)).astype(np.float32)
    y = rng.standard_normal((c.R, c.C, c.H)).astype(c.dtype)
    g = rng.standard_normal((c.R, c.T, c.H)).astype(c.dtype)
    return x, idx, w, y, g


def check_dispatch(outs, ref, R, C):
    for r in range(R):
        o = outs[r]
        for k in DISPATCH_FIELDS:
            want = ref[k][r].reshape(np.shape(o[k]))
            assert (bits(o[k]) == bits(want)).all(), f"rank {r} {k}: {o[k]} != {want}"
    counts = np.stack([o["counts"] for o in outs])
    # the count matrix is all-gathered: every rank holds the same one, and the reference's
    # send_row is the receiver's base row plus the send slot, cut at the capacity
    assert (counts == counts[0]).all()
    for s in range(R):
        slot = outs[s]["send_slot"]
        for d in range(R):
            base = int(counts[0][:s, d].sum())
            want = np.where((slot[:, d] >= 0) & (base + slot[:, d] < C), base + slot[:, d], -1)
            assert (ref["send_row"][s][:, d] == want).all(), (s, d)
    return counts, np.stack([o["send_slot"] for o in outs])


def run_round_trip(c: Case, em=None, data=None):
    """dispatch, combine and gather of one case, each compared with the reference."""
    em = em or InternodeEmu(c.R, gpus_per_node=c.G, num_ports=c.ports, qps_per_port=c.qpp,
                            chunk_bytes=c.chunk, seed=c.seed + 1)
    x, idx, w, y, g = data or inputs(c)
    ref = reference(x, idx, w, y, g, E=c.E, C=c.C, G=c.G if c.G < c.R else None)
    outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    assert errs == [""] * c.R
    counts, slot = check_dispatch(outs, ref, c.R, c.C)
    out, errs = em.combine(y, counts, slot, topk=c.K)
    assert errs == [""] * c.R
    for r in range(c.R):
        assert (bits(out[r]) == bits(ref["out"][r])).all(), f"combine rank {r}"
    got, errs = em.gather(g, counts, slot, capacity=c.C, topk=c.K)
    assert errs == [""] * c.R
    for r in range(c.R):
        assert (bits(got[r]) == bits(ref["gather"][r])).all(), f"gather rank {r}"
    assert em.errors() == [""] * c.R
    return em


CASES = [
    Case("basic"),
    Case("bf16_odd_rows_overflow", H=7, dtype=BF16, kind="skewed", C=5, ports=2, qpp=2),
    pytest.param(Case("f16_one_token", T=1, dtype=np.float16), marks=full),
    pytest.param(Case("no_tokens", T=0), marks=full),
    pytest.param(Case("all_ids_minus_one", kind="none"), marks=full),
    pytest.param(Case("collapsed_overflow", kind="collapsed", C=7, K=3), marks=full),
    pytest.param(Case("eight_ranks_three_qps", R=8, E=16, K=3, C=40, T=5, ports=1, qpp=3,
                      chunk=48), marks=full),
    pytest.param(Case("f32_large_chunk_one_qp", H=33, ports=1, qpp=1, chunk=4096), marks=full),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_direct_matches_reference(c):
    run_round_trip(c)


@pytest.mark.parametrize("c", [
    Case("two_nodes_bf16", R=4, G=2, T=8, H=16, K=3, C=32, dtype=BF16, seed=4),
    pytest.param(Case("four_nodes_bf16", R=8, G=2, E=16, T=6, H=8, K=4, C=40, dtype=BF16,
                      seed=5), marks=full),
], ids=lambda c: c.name)
def test_direct_combine_follows_the_node_order(c):
    """With several nodes the direct combine sums per node, rounds each node's partial to
    bf16 and sums the partials over nodes (kernels/common/combine_order.h), bit-exact with
    the reference in that order; the data are such that the one-node order differs."""
    rng = np.random.default_rng(c.seed)
    x, idx, w, y, g = inputs(c, rng)
    # rows of mixed magnitude, so rounding a node's partial changes low bits
    y = (y.astype(np.float32) * np.exp2(rng.integers(-20, 21, size=y.shape))).astype(c.dtype)
    one_node = reference(x, idx, w, y, E=c.E, C=c.C)["out"]
    nodes = reference(x, idx, w, y, E=c.E, C=c.C, G=c.G)["out"]
    assert (bits(one_node) != bits(nodes)).any(), "the data do not tell the orders apart"
    run_round_trip(c, data=(x, idx, w, y, g))


def test_rank_that_receives_nothing_keeps_its_counts():
    """Rank 3 receives no row but sends rows: its count matrix (the combine handle) must be
    the real one, and its combine bit-exact (a zeroed matrix sums the wrong rows)."""
    c = Case("silent_rank", R=4, E=8, K=2, T=5)
    rng = np.random.default_rng(7)
    x, idx, w, y, g = inputs(c, rng)
    idx = np.where(idx >= 6, idx - 6, idx)  # experts 6, 7 (rank 3) are never chosen
    em = run_round_trip(c, data=(x, idx, w, y, g))
    assert em is not None


def test_consecutive_calls_reuse_halves():
    """Nine calls on one world (both heap halves reused four times each, signal words reset
    in between), each bit-exact."""
    c = Case("reuse", R=4, T=4, H=5, dtype=BF16)
    em = InternodeEmu(c.R, num_ports=2, qps_per_port=2, chunk_bytes=32, seed=5)
    rng = np.random.default_rng(11)
    for _ in range(3):
        run_round_trip(c, em=em, data=inputs(c, rng))


# ------------------------------------------------------------------------------- faults

def _failed_outputs(o, C):
    """A failed dispatch's outputs: NaN floats, -1 counts, ids and sources."""
    assert np.isnan(o["recv_x"].astype(np.float32)).all()
    assert np.isnan(o["recv_w"]).all()
    assert (o["recv_idx"] == -1).all() and (o["src_rank"] == -1).all()
    assert (o["src_index"] == -1).all()
    assert int(o["num_recv"]) == -1 and int(o["num_dropped"]) == -1
    assert (o["per_expert"] == -1).all() and (o["counts"] == -1).all()


def test_bad_id_fails_every_rank_with_nan_outputs():
    c = Case("bad_id")
    x, idx, w, y, g = inputs(c)
    idx[1, 2, 0] = c.E + 3
    em = InternodeEmu(c.R, chunk_bytes=c.chunk)
    outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    assert errs == [""] * c.R  # the handlers return; the kernels record the error
    recorded = em.errors()
    assert "topk_idx[2, 0] = 11 is outside [-1, 8)" in recorded[1]
    for r in (0, 2, 3):
        assert "rank 1 reported an error" in recorded[r], recorded[r]
    for o in outs:
        _failed_outputs(o, c.C)
    # the next call on any rank returns the recorded error before launching anything
    out, errs = em.combine(y, np.zeros((c.R, c.R, c.R), np.int32),
                           np.full((c.R, c.T, c.R), -1, np.int32), topk=c.K)
    assert all("reported an error" in e or "is outside" in e for e in errs), errs


@full
def test_failed_combine_and_gather_are_nan():
    c = Case("fail_combine")
    x, idx, w, y, g = inputs(c)
    em = InternodeEmu(c.R, chunk_bytes=c.chunk)
    outs, _ = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    out, _ = em.combine(y, counts, slot, topk=c.K, skip=(2,))
    assert "rank 2" in em.errors()[0]
    for r in (0, 1, 3):
        assert np.isnan(out[r]).all(), f"rank {r}"


def test_rank_that_skips_a_call_times_out_everywhere():
    c = Case("skip")
    x, idx, w, y, g = inputs(c)
    em = InternodeEmu(c.R, chunk_bytes=c.chunk)
    outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C, skip=(2,))
    recorded = em.errors()
    for r in (0, 1, 3):
        assert "timed out" in recorded[r] and "rank 2" in recorded[r], recorded[r]
        _failed_outputs(outs[r], c.C)


@full
def test_mismatched_config_fails_every_rank():
    c = Case("mismatch")
    x, idx, w, y, g = inputs(c)
    em = InternodeEmu(c.R, chunk_bytes=c.chunk)
    outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C,
                             per_rank_attrs=[dict(call_site=9 if r == 0 else 0)
                                             for r in range(c.R)])
    recorded = em.errors()
    assert all("is in another call" in e for e in recorded), recorded


# ----------------------------------------------------------------- the wire vs the plan

def _data_puts(log):
    return [r for r in log if r["sig_op"] == SIGNAL_ADD]


@pytest.mark.parametrize("ports,qpp,chunk", [(2, 2, 48), pytest.param(4, 1, 64, marks=full)])
def test_transport_log_matches_stripe(ports, qpp, chunk, transport):
    """Bytes per QP handle and per port of every data stream, as the emulated NIC logged
    them, equal TransportConfig.stripe of the stream (jax_ep.network.plan.check_wire_log);
    headers and count rows go on QP 0. A change of SendKernel's QP choice fails it. Over
    NCCL the node has its two ports as two devices (node8_roce_pairs): on the standard
    node's one dual-port device NCCL puts every context on port 1
    (test_nccl_standard_node_one_port)."""
    if transport == "nccl" and ports != 2:
        pytest.skip("the NCCL case's node (node8_roce_pairs) has two ports per GPU")
    c = Case("wire", R=4, T=10, H=24, K=3, E=8, C=40, ports=ports, qpp=qpp, chunk=chunk)
    sysfs = os.path.join(SYSFS, "node8_roce_pairs") if transport == "nccl" else None
    em = InternodeEmu(c.R, num_ports=ports, qps_per_port=qpp, chunk_bytes=chunk, seed=3,
                      sysfs=sysfs)
    x, idx, w, y, g = inputs(c)
    outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    assert errs == [""] * c.R
    counts = np.stack([o["counts"] for o in outs])
    slot = np.stack([o["send_slot"] for o in outs])
    em.combine(y, counts, slot, topk=c.K)
    log, pending = em.log()
    assert pending == 0, "a call finished with operations still queued"
    cfg = TransportConfig(num_ports=ports, qps_per_port=qpp, chunk_bytes=chunk)
    data = _data_puts(log)
    streams = {(r["call"], r["src"], r["dst"]) for r in data}
    assert len({s[0] for s in streams}) == 2, "dispatch and combine both sent data"
    assert max(r["bytes"] for r in data) == (chunk + 15) // 16 * 16
    res = check_wire_log(cfg, log)
    assert res["ok"], res["disagreements"]
    assert res["records"] == len(data)
    control = [r for r in log if r["sig_op"] == SIGNAL_SET]
    assert control and all(r["qp"] == 0 for r in control)
    # every stream used more than one QP, so a QP choice that ignores the plan shows
    per_stream = {}
    for r in data:
        per_stream.setdefault((r["call"], r["src"], r["dst"]), set()).add(r["qp"])
    assert max(len(q) for q in per_stream.values()) == ports * qpp
    # the checker rejects the same log with one chunk moved to another QP
    moved = [dict(r) for r in data]
    q0 = moved[0]["qp"]
    moved[0]["qp"] = (q0 + 1) % (ports * qpp)
    moved[0]["port"] = moved[0]["qp"] % ports
    assert not check_wire_log(cfg, moved)["ok"]


@pytest.mark.transport_only("nccl")
def test_nccl_standard_node_one_port(transport):
    """The standard node has one dual-port HCA per GPU: NCCL's GDAKI makes every QP on port
    1 of it (nccl_select.h), so the emulated NIC logs every context on one port and the
    check against a two-port plan fails, naming the port: both ports are not true there
    over NCCL (docs/internode.md, "How NCCL picks ports for GIN contexts")."""
    c = Case("wire1", R=4, T=10, H=24, K=3, E=8, C=40, ports=2, qpp=1, chunk=48)
    em = InternodeEmu(c.R, num_ports=2, qps_per_port=1, chunk_bytes=48, seed=3)
    x, idx, w, y, g = inputs(c)
    _, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    assert errs == [""] * c.R
    log, _ = em.log()
    data = _data_puts(log)
    assert {r["qp"] for r in data} == {0, 1}
    assert {r["wire"] for r in data} == {"mlx5_0:1"}  # one node GPU: its HCA, port 1
    res = check_wire_log(TransportConfig(num_ports=2, qps_per_port=1, chunk_bytes=48), log)
    assert not res["ok"] and "went out on port 0" in " ".join(res["disagreements"])


def test_counters_per_qp(transport):
    """The emulated transport counts puts, signals and work requests per QP (NCCL: per GIN
    context); they add up to the log (a put-with-signal is two work requests)."""
    c = Case("counters", R=4, T=8, H=16, ports=2, qpp=1, chunk=64)
    em = InternodeEmu(c.R, num_ports=2, qps_per_port=1, chunk_bytes=64, seed=2)
    em.emu.reset_counters()
    x, idx, w, y, g = inputs(c)
    em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C)
    log, _ = em.log()
    cnt = em.counters()
    pre = "nvshmem:qp" if transport == "nvshmem" else "nccl:ctx"
    for q in range(2):
        puts = [r for r in log if r["qp"] == q]
        assert puts
        assert cnt.get(f"{pre}{q}:puts", 0) == len(puts)
        assert cnt.get(f"{pre}{q}:bytes", 0) == sum(r["bytes"] for r in puts)
        assert cnt.get(f"{pre}{q}:wrs", 0) >= 2 * len(puts)
        # every data put signals, plus one closing signal per (peer, QP)
        assert cnt.get(f"{pre}{q}:signals", 0) > len([r for r in puts if r["sig_op"] >= 0])


@full
def test_direct_combine_hand_computed_node_order():
    """8 ranks in 4 nodes of 2, every token on every rank: source 0's token comes back
    with the rows 2^30, 0 | -2^30, 0 | 1, 2^-8 | 2^-8, 0 (bf16). In the order, the node
    partials are 2^30, -2^30, bf16(1 + 2^-8) = 1 (tie to even), 2^-8, summing to 1 + 2^-8,
    which casts to 1.0; partials unrounded give 1.0078125, nodes descending 0.0, one node
    1.0078125 (tests/test_combine_order.py has the same case on the CPU backends)."""
    c = Case("hand_order", R=8, G=2, T=1, H=2, K=8, E=8, C=8, dtype=BF16)
    x = np.ones((8, 1, 2), np.float32).astype(BF16)
    idx = np.tile(np.arange(8, dtype=np.int32), (8, 1, 1))
    w = np.ones((8, 1, 8), np.float32)
    y = np.zeros((8, 8, 2), np.float32)
    y[:, 0, 0] = [2.0 ** 30, 0.0, -2.0 ** 30, 0.0, 1.0, 2.0 ** -8, 2.0 ** -8, 0.0]
    y[:, 0, 1] = 1.0
    y = y.astype(BF16)
    g = np.ones((8, 1, 2), np.float32).astype(BF16)
    em = run_round_trip(c, data=(x, idx, w, y, g))
    assert em is not None
    ref = reference(x, idx, w, y, E=8, C=8, G=2)["out"]
    assert float(ref[0][0, 0]) == 1.0 and float(ref[0][0, 1]) == 8.0


# ------------------------------------------------------------------------- RDMA first

# Over NCCL a copy to a peer of the node is the warp's own (LSA), which no NIC logs.
@pytest.mark.transport_only("nvshmem")
@pytest.mark.parametrize("R,G,ports,qpp", [(4, 2, 2, 1), pytest.param(8, 4, 1, 2, marks=full)])
def test_rdma_posted_before_nvlink_copies(R, G, ports, qpp):
    """In every direct call (dispatch, combine, gather), each rank's puts to peers on other
    nodes are all issued (logged by the emulated NIC) before its first copy to a peer of its
    own node, the remote puts come from the RDMA CTAs (blocks < num_qps) only and the
    copies from the NVLink CTAs after them; the results stay bit-exact."""
    c = Case("rdma_first", R=R, G=G, T=8, H=16, K=3, E=2 * R, C=8 * R, ports=ports, qpp=qpp,
             chunk=32, seed=6)
    em = InternodeEmu(R, gpus_per_node=G, num_ports=ports, qps_per_port=qpp, chunk_bytes=32,
                      seed=9)
    run_round_trip(c, em=em)
    log, pending = em.log()
    assert pending == 0
    data = _data_puts(log)
    qps = ports * qpp
    # SendKernel's RDMA CTAs (configs.h DirectSendSplit of the mode's SMs)
    nr = em.emu.m.mode_sms(R, num_qps=qps, nvlink_peers=G > 1)["direct_rdma_ctas"]
    assert 1 <= nr <= qps
    checked = 0
    for call in sorted({r["call"] for r in data}):
        for src in range(R):
            mine = [(i, r) for i, r in enumerate(data) if r["call"] == call and r["src"] == src]
            remote = [i for i, r in mine if r["dst"] // G != src // G]
            local = [i for i, r in mine if r["dst"] // G == src // G]
            assert remote and local, (call, src)
            assert max(remote) < min(local), f"call {call} rank {src}: a copy before a post"
            for i, r in mine:
                is_remote = r["dst"] // G != src // G
                assert (r["block"] < nr) == is_remote, (call, src, r)
            checked += 1
    assert checked == 3 * R  # dispatch, combine and gather


# ------------------------------------------------------------------------- SM budget

def _blocks_per_launch(counters, kernel):
    blocks = sum(v for k, v in counters.items()
                 if k.startswith(f"kernel:{kernel}") and k.endswith(":blocks"))
    launches = sum(v for k, v in counters.items()
                   if k.startswith(f"kernel:{kernel}") and k.endswith(":launches"))
    return blocks, launches


@pytest.mark.parametrize("sms", [1, 3, pytest.param(7, marks=full)])
def test_direct_sms_budget(sms):
    """JAX_EP_DIRECT_SMS: 2 nodes x 2, 4 QPs; the direct mode's kernels run on that many
    blocks at most (SendKernel exactly: its RDMA and NVLink CTAs, configs.h
    DirectSendSplit; at one SM the one CTA posts, then copies to its NVLink peer), and
    dispatch, combine and gather stay bit-exact against the reference."""
    import jax_ep
    c = Case("budget", R=4, G=2, T=9, H=16, K=3, E=8, C=36, ports=2, qpp=2, chunk=32, seed=5)
    with jax_ep.config.override(direct_sms=sms):
        em = InternodeEmu(c.R, gpus_per_node=c.G, num_ports=c.ports, qps_per_port=c.qpp,
                          chunk_bytes=c.chunk, seed=11)
        split = em.emu.m.mode_sms(c.R, num_qps=4, nvlink_peers=True)
        assert split["direct"] == sms
        assert split["direct_rdma_ctas"] + split["direct_nvlink_ctas"] == sms
        em.emu.reset_counters()
        run_round_trip(c, em=em)
        cnt = em.counters()
    blocks, launches = _blocks_per_launch(cnt, "SendKernel")
    assert launches == 3 * c.R and blocks == launches * sms, (blocks, launches)
    for k in ("SlotsKernel", "PackKernel", "UnpackKernel", "CombineStageKernel",
              "ReduceKernel", "GatherPackKernel", "GatherUnpackKernel"):
        b, n = _blocks_per_launch(cnt, k)
        assert n > 0 and b <= n * sms, (k, b, n)
