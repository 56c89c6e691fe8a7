"""The internode low-latency mode's kernel sources on the emulated GPU (send and receive
halves through their own FFI handlers, over the emulated NVSHMEM), bit-exact against the
reference backend on every row below the counts (rows past an expert's recv_count are
unspecified: the receive half does not write them)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import jax_ep

sys.path.insert(0, os.path.dirname(__file__))
from emu_fp8_util import fp8_msg_bytes, fp8_reference, fp8_rows  # noqa: E402
from emu_intranode_util import (LL_DISPATCH_KEYS, LL_WIDE_ROW_KINDS, LL_WIDE_ROWS,  # noqa: E402
                                assert_same, bits, check_wide_row_routing, ll_reference,
                                ll_routing, rows)
from internode_emu_util import InternodeEmu  # noqa: E402

pytestmark = [pytest.mark.emu, pytest.mark.usefixtures("transport")]
full = pytest.mark.emu_full

GARBAGE = 0xA5  # the emulator's byte in every output before a kernel writes it


def setup(R, S, H, K, E, M, dtype, seed, ports=2, qpp=1, **kw):
    em = InternodeEmu(R, num_ports=ports, qps_per_port=qpp, seed=seed, **kw)
    itemsize = rows(dtype, (1,), np.random.default_rng(0)).dtype.itemsize
    em.ll_init(max_tokens=M, row_bytes=H * itemsize, topk=K, num_experts=E)
    return em


def inputs(R, S, H, K, E, M, dtype, rng, p_unused=0.2):
    idx = ll_routing(R, S, K, E, rng, p_unused) if S else np.zeros((R, 0, K), np.int32)
    x = rows(dtype, (R, S, H), rng)
    w = rng.standard_normal((R, S, K)).astype(np.float32)
    y = rows(dtype, (R, E // R, R * M, H), rng)
    return x, idx, w, y


def below_count(d):
    """A copy of results whose recv_x rows past each expert's recv_count are zero (they are
    unspecified), so a comparison covers the rows below the counts only."""
    d = dict(d)
    rx = np.array(d["recv_x"])
    n = rx.shape[2]
    past = np.arange(n)[None, None, :] >= np.asarray(d["recv_count"])[:, :, None]
    rx[past] = 0
    d["recv_x"] = rx
    return d


def untouched_past_counts(d):
    """True if every recv_x row past its expert's count still holds the emulator's garbage
    bytes (the receive half wrote none of them)."""
    rx = np.asarray(d["recv_x"])
    raw = rx.view(np.uint8).reshape(rx.shape[:3] + (-1,))
    past = np.arange(rx.shape[2])[None, None, :] >= np.asarray(d["recv_count"])[:, :, None]
    return bool((raw[past] == GARBAGE).all())


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


def check_round(got, want, what):
    assert_same(below_count(got), below_count(want), LL_DISPATCH_KEYS + ("out",), what)


CASES = [(4, 5, 8, 2, 8, 6, "bf16", 1), pytest.param(4, 3, 3, 3, 8, 4, "f32", 2, marks=full),
         pytest.param(2, 1, 24, 1, 4, 1, "f16", 3, marks=full)]


@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", CASES)
def test_ll_matches_reference(R, S, H, K, E, M, dtype, seed):
    """Bit-exact below the counts (H = 8 bf16 rows reduce 16 bytes per load; H = 3 f32
    and 24 f16 rows element by element); nothing past the counts is written."""
    em = setup(R, S, H, K, E, M, dtype, seed)
    rng = np.random.default_rng(seed)
    x, idx, w, y = inputs(R, S, H, K, E, M, dtype, rng)
    got, rpd = one_round(em, x, idx, w, y, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    check_round(got, want, f"seed {seed}: ")
    assert untouched_past_counts(got)
    assert em.errors() == [""] * R


@pytest.mark.parametrize("H,dtype,seed",
                         [k + (s,) for k, s in zip(LL_WIDE_ROW_KINDS, (21, 22))])
def test_ll_combine_top_k_past_one_batch_over_wide_rows(H, dtype, seed):
    """The internode combine's receive sum over the wide-row case
    (emu_intranode_util.LL_WIDE_ROWS), bit-exact as the intranode one's."""
    R, S, K, E, M = (LL_WIDE_ROWS[k] for k in "RSKEM")
    em = setup(R, S, H, K, E, M, dtype, seed)
    rng = np.random.default_rng(seed)
    x, idx, w, y = inputs(R, S, H, K, E, M, dtype, rng)
    check_wide_row_routing(idx)
    got, rpd = one_round(em, x, idx, w, y, K=K)
    check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd), f"H={H}: ")
    assert em.errors() == [""] * R


def test_ll_combine_items_fill_the_grid():
    """The receive sum deals (token, chunk) items over the grid's warps, not a warp per
    token: 4 tokens of 2048 bf16 (256 vectors, 4 items each) are 16 items, 2 blocks of 8
    warps on each rank, where a warp per token fits in one."""
    R, S, H, K, E, M = 2, 4, 2048, 2, 4, 4
    em = setup(R, S, H, K, E, M, "bf16", 23)
    rng = np.random.default_rng(23)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
    em.emu.reset_counters()
    got, rpd = one_round(em, x, idx, w, y, K=K)
    check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd), "")
    assert em.counters()["kernel:CombineReduce:blocks"] == 2 * R


@pytest.mark.parametrize("seed,max_delay", [(11, 32), (12, 4000)])
def test_ll_consecutive_calls_reuse_halves_parities_and_credits(seed, max_delay):
    """Eight rounds (dispatch and combine each: four wraps of the two parity halves, of
    the send stages and of the credits the readers hand back) with fresh routing and rows
    every round: each round bit-exact, so a half or stage reused before its credit, or
    read with last round's parity, shows. With long transport delays a send's puts are
    still queued when the next send would rewrite a stage (their source bytes are read at
    delivery): only the credit wait before staging keeps them."""
    R, S, H, K, E, M = 4, 3, 8, 2, 8, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=seed, max_delay=max_delay)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(seed)
    for i in range(8):
        x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
        got, rpd = one_round(em, x, idx, w, y, K=K)
        want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
        check_round(got, want, f"round {i}: ")
    assert em.errors() == [""] * R


def test_ll_send_halves_return_with_puts_undelivered():
    """With transport delays on, both send halves finish (every rank's kernels done)
    while some of their puts are still queued in the emulated NVSHMEM and without a
    quiet; the receive halves then complete the same calls bit-exact."""
    R, S, H, K, E, M = 4, 6, 8, 2, 8, 6
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=21, max_delay=4000)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(21)
    rpd = M * min(K, E // R)
    for i in range(3):
        x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng, p_unused=0.0)
        em.log()  # clears the log
        quiets = em.counters().get("nvshmem:quiets", 0)
        tok, errs = em.ll_dispatch_send(x, idx)
        assert errs == [""] * R, errs
        _, pending_dispatch = em.log()
        d, errs = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
        assert errs == [""] * R, errs
        first = np.stack([o["first_row"] for o in d])
        count = np.stack([o["row_count"] for o in d])
        tok, errs = em.ll_combine_send(y, first, count, rows_per_dest=rpd)
        assert errs == [""] * R, errs
        _, pending_combine = em.log()
        out, errs = em.ll_combine_recv(tok, idx, w, H=H, dtype=x.dtype)
        assert errs == [""] * R, errs
        assert pending_dispatch > 0 and pending_combine > 0, (pending_dispatch,
                                                              pending_combine)
        assert em.counters().get("nvshmem:quiets", 0) == quiets
        got = {k: np.stack([o[k] for o in d]) for k in LL_DISPATCH_KEYS}
        got["out"] = np.stack(out)
        check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd),
                    f"round {i}: ")


def wire_counts(em, idx, E, before, after):
    """(rows a dispatch puts on the wire, readers each writer signals, signals counted):
    over NVSHMEM every rank, itself included; over NCCL GIN not itself (a rank's own rows
    and words are its warps' copies, transport_nccl_gin.cuh), with one node GPU each."""
    R = idx.shape[0]
    pre = "nvshmem:qp" if em.transport == "nvshmem" else "nccl:ctx"
    sig = sum(after.get(k, 0) - before.get(k, 0) for k in after
              if k.startswith(pre) and k.endswith(":signals"))
    if em.transport == "nvshmem":
        return int((idx >= 0).sum()), R, sig
    owner = np.where(idx >= 0, idx // (E // R), -1)
    mine = np.arange(R)[:, None, None]
    return int(((idx >= 0) & (owner != mine)).sum()), R - 1, sig


def test_ll_one_count_signal_per_expert_and_source(transport):
    """Rows go as plain puts, then one count signal per (writer, reader's expert): the
    signals of a dispatch are R * E (the experts with no rows included), never one per
    row, and every row put carries no signal."""
    R, S, H, K, E, M = 4, 5, 8, 2, 8, 6
    em = setup(R, S, H, K, E, M, "bf16", 31)
    rng = np.random.default_rng(31)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
    em.log()
    before = em.counters()
    tok, errs = em.ll_dispatch_send(x, idx)
    assert errs == [""] * R, errs
    log, _ = em.log()
    rows_sent, readers, sig = wire_counts(em, idx, E, before, em.counters())
    headers = [p for p in log if p["sig_op"] >= 0]
    plain = [p for p in log if p["sig_op"] < 0]
    assert len(headers) == R * readers and len(plain) == rows_sent, (len(headers), len(plain))
    # headers, then one count per (source, reader's expert)
    assert sig == R * readers + readers * E, sig
    d, errs = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
    assert errs == [""] * R, errs


@pytest.mark.parametrize("kind", ["no_tokens", "all_unused"])
def test_ll_empty_calls(kind):
    """T = 0 on every rank, or every id -1: every count 0, combine's out zero (T = 0: no
    rows at all), and the next call still right (the empty one's credits came back)."""
    R, H, K, E, M = 2, 8, 2, 4, 4
    S = 0 if kind == "no_tokens" else 3
    em = setup(R, S, H, K, E, M, "bf16", 41)
    rng = np.random.default_rng(41)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
    idx[:] = -1
    for i in range(3):
        got, rpd = one_round(em, x, idx, w, y, K=K)
        assert (got["recv_count"] == 0).all() and (got["row_count"] == 0).all()
        assert (got["src_rank"] == -1).all() and (got["src_index"] == -1).all()
        assert (got["first_row"] == 0).all()
        if S == 0:  # the reference's shard_map does not take T = 0
            assert got["out"].shape == (R, 0, H)
            continue
        want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
        check_round(got, want, f"{kind} round {i}: ")
    x, idx, w, y = inputs(R, 3, H, K, E, M, "bf16", rng)
    got, rpd = one_round(em, x, idx, w, y, K=K)
    check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd), "after: ")


def test_ll_grids_fit_the_sm_budget(monkeypatch):
    """JAX_EP_NUM_SMS caps every grid (one block per SM on the emulated GPU): with a
    budget of 1 each multi-block kernel runs 1 block per rank where the work asks for
    more, and the grid-stride loops still cover every row; JAX_EP_LOW_LATENCY_SMS=2, the
    mode's own budget, cuts them to 2."""
    R, S, H, K, E, M = 2, 20, 8, 2, 4, 20
    em = setup(R, S, H, K, E, M, "bf16", 51)
    rng = np.random.default_rng(51)
    kernels = ("DispatchSendKernel", "DispatchUnpack", "CombineSendKernel", "CombineReduce")

    def blocks(budget, setting="num_sms"):
        if budget is None:
            jax_ep.config.update(setting, None)
        else:
            jax_ep.config.update(setting, str(budget))
        x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
        em.emu.reset_counters()
        got, rpd = one_round(em, x, idx, w, y, K=K)
        check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd),
                    f"budget {budget}: ")
        c = em.counters()
        return {k: c[f"kernel:{k}:blocks"] // R for k in kernels}

    free = blocks(None)
    assert all(v > 1 for v in free.values()), free  # the work asks for several blocks
    assert blocks(1) == {k: 1 for k in kernels}
    jax_ep.config.update("num_sms", None)
    # the mode's own budget (JAX_EP_LOW_LATENCY_SMS) cuts the grids the same way
    assert blocks(2, "low_latency_sms") == {k: min(2, v) for k, v in free.items()}
    jax_ep.config.update("low_latency_sms", None)


def test_ll_rank_that_skips_a_call_ends_in_errors_on_every_rank():
    """Rank 1 skips a dispatch (both halves): rank 0's receive half times out waiting for
    rank 1's header. Rank 1 is then a call behind, so later calls meet rank 0's failed
    state or time out themselves: within a few calls every rank reports an error, none
    hangs."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=5, timeout_s=0.002)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(5)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng)
    tok, errs = em.ll_dispatch_send(x, idx, skip=[1])
    d, errs2 = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype, skip=[1])
    # a failed receive half marks its results: counts and first rows -1, sources -1, rows NaN
    assert d[1] is None and (d[0]["recv_count"] == -1).all(), d[0]["recv_count"]
    assert (d[0]["src_rank"] == -1).all() and (d[0]["row_count"] == -1).all()
    assert np.isnan(d[0]["recv_x"].astype(np.float32)).all()
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
    """Two dispatch send halves before either receive half (values and scales as a pair),
    three times: the second send stages into the other parity while, with long transport
    delays, the first one's puts (their source read at delivery) are still queued. Both
    receives bit-exact below the counts."""
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
            assert_same(below_count(got), below_count(want), LL_DISPATCH_KEYS,
                        f"seed {seed} round {i} {name}: ")
    assert em.ll_errors() == [""] * R


def test_ll_third_send_in_flight_fails_on_its_credit():
    """A third dispatch send before any receive would rewrite parity 0 (its stage and the
    owners' rows) while the first call's puts and reads are still due: it waits for the
    credit of epoch 1, which only a receive behind it can give, and every rank fails with
    that credit named, never a silent overwrite or a hang."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = InternodeEmu(R, num_ports=2, qps_per_port=1, seed=61, timeout_s=0.002,
                      max_delay=4000)
    em.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
    rng = np.random.default_rng(61)
    for i in range(3):
        x, idx, _, _ = inputs(R, S, H, K, E, M, "bf16", rng)
        _, errs = em.ll_dispatch_send(x, idx)
        assert errs == [""] * R, errs
        if i < 2:
            assert em.ll_errors() == [""] * R
    errs = em.ll_errors()
    assert all("its credit" in e for e in errs), errs


@pytest.mark.parametrize("R,E,M,K,H,ports,qpp,seed", [
    pytest.param(8, 16, 3, 4, 2, 2, 2, 71, marks=full),  # 8 ranks, 4 QPs per peer
    (4, 4, 6, 1, 2, 1, 3, 72),                             # one port, three QPs
])
def test_ll_more_ranks_and_qp_shapes(R, E, M, K, H, ports, qpp, seed):
    """Three rounds at 8 ranks over 2 ports x 2 QPs, and at 4 ranks over 1 port x 3 QPs
    (experts spread over the QPs, each expert's rows and count on one), bit-exact below
    the counts."""
    em = setup(R, M, H, K, E, M, "bf16", seed, ports=ports, qpp=qpp)
    rng = np.random.default_rng(seed)
    for i in range(3):
        x, idx, w, y = inputs(R, M, H, K, E, M, "bf16", rng)
        got, rpd = one_round(em, x, idx, w, y, K=K)
        check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd),
                    f"R={R} round {i}: ")
    assert em.errors() == [""] * R


def test_widen_epoch_recovers_the_epoch_from_its_low_bits():
    """The token carries an epoch's low 32 bits; the receive half widens them against its
    PE's counter, which is at the epoch or one call further (two sends in flight), past
    2^31 and 2^32 calls too (the compiled rule, through the bindings)."""
    from jax_ep import _jax_ep_ext as ext
    for n in (1, 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**32 + 7):
        for ahead in (0, 1):
            assert ext.ll_widen_epoch(n + ahead, n & 0xFFFFFFFF) == n, (n, ahead)


def test_ll_bad_id_fails_every_rank():
    """An id outside [-1, E) on rank 0 travels in its headers' error flag: rank 0 names
    the slot, every other rank names rank 0; no rank waits out the timeout for rows."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = setup(R, S, H, K, E, M, "bf16", 81)
    x, idx, _, _ = inputs(R, S, H, K, E, M, "bf16", np.random.default_rng(81))
    idx[0, 1, 0] = E
    tok, errs = em.ll_dispatch_send(x, idx)
    em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
    errs = em.ll_errors()
    assert "topk_idx[1, 0] = 4 is outside" in errs[0], errs
    assert all("rank 0 reported an error" in e for e in errs[1:]), errs


def test_ll_other_shape_on_one_rank_is_a_mismatch_on_every_rank():
    """Rank 1 dispatches a wider row than rank 0 (another call's shape): the config hash
    in the headers differs, and every rank reports the mismatch."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = setup(R, S, 2 * H, K, E, M, "bf16", 82)
    rng = np.random.default_rng(82)
    x, idx, _, _ = inputs(R, S, H, K, E, M, "bf16", rng)
    wide = rows("bf16", (S, 2 * H), rng)
    res, errs = em._ll("dispatch_send", [[x[0], idx[0]], [wide, idx[1]]],
                       [[((2,), np.int32)]] * R)
    assert errs == [""] * R, errs
    em._ll("dispatch_recv", [[res[0][0]], [res[1][0]]],
           [[((E // R, R * M, h), np.dtype(x.dtype)), ((E // R,), np.int32),
             ((E // R, R * M), np.int32), ((E // R, R * M), np.int32),
             ((E // R, R), np.int32), ((E // R, R), np.int32)] for h in (H, 2 * H)])
    errs = em.ll_errors()
    assert all("is in another call" in e for e in errs), errs


def test_ll_combine_with_other_routing_is_an_error_on_that_source():
    """A combine whose receive half is given routing other than its dispatch's: the
    owners' per-expert counts differ from what the source's routing implies, and that
    source reports it (never a silently wrong sum)."""
    R, S, H, K, E, M = 2, 3, 8, 2, 4, 4
    em = setup(R, S, H, K, E, M, "bf16", 83)
    rng = np.random.default_rng(83)
    x, idx, w, y = inputs(R, S, H, K, E, M, "bf16", rng, p_unused=0.0)
    tok, errs = em.ll_dispatch_send(x, idx)
    d, errs = em.ll_dispatch_recv(tok, H=H, dtype=x.dtype)
    assert errs == [""] * R, errs
    first = np.stack([o["first_row"] for o in d])
    count = np.stack([o["row_count"] for o in d])
    tok, errs = em.ll_combine_send(y, first, count, rows_per_dest=M * min(K, E // R))
    other = idx.copy()
    other[1] = -1  # rank 1 claims it routed nothing
    em.ll_combine_recv(tok, other, w, H=H, dtype=x.dtype)
    errs = em.ll_errors()
    assert errs[0] == "" and "this rank's routing expects 0" in errs[1], errs


def fp8_send(em, x, idx, round_scale=False, skip=()):
    """The FP8 send halves: x[R, S, H] cast in the send kernel -> tokens[R, 2]."""
    res, errs = em._ll("dispatch_send_fp8", [[x[r], idx[r]] for r in range(em.R)],
                       [[((2,), np.int32)]] * em.R, skip, round_scale=int(bool(round_scale)))
    return [None if o is None else o[0] for o in res], errs


def fp8_recv(em, tokens, *, H, skip=()):
    """The FP8 receive halves -> per-rank dicts with recv_x (float8_e4m3fn), recv_scales
    and the handle."""
    import ml_dtypes
    E, M, R = em.ll["num_experts"], em.ll["max_tokens"], em.R
    el = E // R
    names = ("recv_x", "recv_scales", "recv_count", "src_rank", "src_index", "first_row",
             "row_count")
    shapes = ((el, R * M, H), (el, R * M, H // 128), (el,), (el, R * M), (el, R * M),
              (el, R), (el, R))
    dts = (np.dtype(ml_dtypes.float8_e4m3fn), np.float32) + (np.int32,) * 5
    res, errs = em._ll("dispatch_recv_fp8", [[t] if t is not None else [] for t in tokens],
                       [list(zip(shapes, dts))] * R, skip)
    return [None if o is None else dict(zip(names, o)) for o in res], errs


def check_fp8(d, want, what=""):
    got = {k: np.stack([o[k] for o in d]) for k in want}
    assert_same(got, want, LL_DISPATCH_KEYS[1:], what)
    for r in range(got["recv_x"].shape[0]):
        for e in range(got["recv_x"].shape[1]):
            c = int(want["recv_count"][r, e])
            for key in ("recv_x", "recv_scales"):
                np.testing.assert_array_equal(bits(got[key][r, e, :c]), bits(want[key][r, e, :c]),
                                              err_msg=f"{what}{key} rank {r} expert {e}")


@pytest.mark.parametrize("dtype,H,round_scale", [("bf16", 256, False),
                                                 pytest.param("f32", 384, True, marks=full),
                                                 pytest.param("f16", 128, True, marks=full)])
def test_ll_fp8_one_message_two_in_flight(dtype, H, round_scale):
    """fp8: the send kernel casts each row (values and 1 x 128 scales in one message per
    (token, expert)); two FP8 sends in flight before either receive (both parities),
    three rounds, each bit-exact against the reference backend's jax_ep.fp8.quantize
    pair and handle."""
    R, S, K, E, M = 2, 3, 2, 4, 4
    em = setup(R, S, fp8_msg_bytes(H), K, E, M, "f16", 91)  # rows of one message
    rng = np.random.default_rng(91 + H)
    for i in range(3):
        cases = []
        for rs in (round_scale, not round_scale):
            x = fp8_rows(R, S, H, dtype, rng)
            idx = ll_routing(R, S, K, E, rng)
            tok, errs = fp8_send(em, x, idx, rs)
            assert errs == [""] * R, errs
            cases.append((tok, fp8_reference(x, idx, E=E, M=M, round_scale=rs)))
        for j, (tok, want) in enumerate(cases):
            d, errs = fp8_recv(em, tok, H=H)
            assert errs == [""] * R, errs
            check_fp8(d, want, f"round {i} send {j}: ")
    assert em.ll_errors() == [""] * R


@pytest.mark.parametrize("kind", ["all_unused", "one_token"])
def test_ll_fp8_no_rows_and_one_token(kind):
    """All ids -1 (headers and count signals only) and T = 1, H = 128: exact."""
    R, S, H, K, E, M = 2, 1 if kind == "one_token" else 3, 128, 2, 4, 3
    em = setup(R, S, fp8_msg_bytes(H), K, E, M, "f16", 92)
    rng = np.random.default_rng(92)
    x = fp8_rows(R, S, H, "bf16", rng)
    idx = ll_routing(R, S, K, E, rng, 0.0)
    if kind == "all_unused":
        idx[:] = -1
    tok, errs = fp8_send(em, x, idx)
    assert errs == [""] * R, errs
    d, errs = fp8_recv(em, tok, H=H)
    assert errs == [""] * R, errs
    want = fp8_reference(x, idx, E=E, M=M, round_scale=False)
    check_fp8(d, want)
    if kind == "all_unused":
        assert (want["recv_count"] == 0).all()
    assert em.ll_errors() == [""] * R


def test_ll_fp8_one_put_per_token_and_expert(transport):
    """The transport log of an FP8 dispatch: one plain put per (token, expert) of one
    message's bytes (values, scales and the token index), R * R headers and R * E count
    signals; the values and scales as two dispatches of one routing post twice the puts
    and signals."""
    import jax.numpy as jnp

    from jax_ep import fp8
    R, S, H, K, E, M = 2, 4, 256, 2, 4, 4
    em = setup(R, S, 4 * H, K, E, M, "f16", 93)
    rng = np.random.default_rng(93)
    x = fp8_rows(R, S, H, "f32", rng)
    idx = ll_routing(R, S, K, E, rng)

    def posted(f):
        em.log()
        before = em.counters()
        tokens = f()
        log, _ = em.log()
        _, _, sig = wire_counts(em, idx, E, before, em.counters())
        return tokens, [p for p in log if p["sig_op"] < 0], sig

    rows_sent, readers, _ = wire_counts(em, idx, E, {}, {})

    def one():
        tok, errs = fp8_send(em, x, idx)
        assert errs == [""] * R, errs
        return tok

    tok, plain, sig = posted(one)
    assert len(plain) == rows_sent and sig == R * readers + readers * E, (len(plain), sig)
    # A message: H values and H / 128 scales padded to 16, then the 16-byte token index.
    assert {p["bytes"] for p in plain} == {fp8_msg_bytes(H) + 16}
    d, errs = fp8_recv(em, tok, H=H)
    assert errs == [""] * R, errs
    check_fp8(d, fp8_reference(x, idx, E=E, M=M, round_scale=False))
    q, s = (np.asarray(a) for a in fp8.quantize(jnp.asarray(x), block=128))

    def two():
        toks = []
        for part in (q, s):
            tok, errs = em.ll_dispatch_send(part, idx)
            assert errs == [""] * R, errs
            toks.append((tok, part))
        return toks

    toks, plain2, sig2 = posted(two)
    assert len(plain2) == 2 * len(plain) and sig2 == 2 * sig, (len(plain2), sig2)
    for tok, part in toks:
        _, errs = em.ll_dispatch_recv(tok, H=part.shape[-1], dtype=part.dtype)
        assert errs == [""] * R, errs
    assert em.ll_errors() == [""] * R
