"""The host simulator of the low-latency mode on real intranode ranks
(tests/sim/intranode_ll_sim.py, a model on the CPU, not a GPU run): bit-exact results
against the NumPy model of the contract under random interleavings of ranks running at
their own pace, repeated calls, fault cases, and every planted mistake caught."""
import numpy as np
import pytest

import intranode_ll_sim as S

R, T, M, H, K, E = 4, 5, 6, 8, 3, 8
SETUP = S.Setup(R=R, E=E, M=M, K=K, H=H)


# --- NumPy model of the contract (docs/low_latency.md) ----------------------------------

def np_dispatch(x, idx, E_, M_):
    Rn, Tn, Hn = x.shape
    el = E_ // Rn
    res = []
    for r in range(Rn):
        recv = np.zeros((el, Rn * M_, Hn), x.dtype)
        src_rank = np.full((el, Rn * M_), -1, np.int32)
        src_index = np.full((el, Rn * M_), -1, np.int32)
        first = np.zeros((el, Rn), np.int32)
        rows = np.zeros((el, Rn), np.int32)
        count = np.zeros(el, np.int32)
        for e in range(el):
            g, row = r * el + e, 0
            for s in range(Rn):
                first[e, s] = row
                for t in range(Tn):
                    if g in idx[s, t]:
                        recv[e, row] = x[s, t]
                        src_rank[e, row], src_index[e, row] = s, t
                        row += 1
                rows[e, s] = row - first[e, s]
            count[e] = row
        res.append(dict(recv=recv, count=count, src_rank=src_rank, src_index=src_index,
                        first_row=first, row_count=rows))
    return res


def np_combine(ys, idx, w, model, zero_owners=()):
    """Per source rank out[T, H]; rows of `zero_owners` count as zero (skipped)."""
    Rn, Tn, Kn = idx.shape
    el = ys[0].shape[0]
    outs = []
    for s in range(Rn):
        out = np.zeros((Tn, ys[0].shape[-1]), ys[0].dtype)
        for t in range(Tn):
            acc = np.zeros(ys[0].shape[-1], np.float32)
            for k in range(Kn):
                g = idx[s, t, k]
                if g < 0:
                    continue
                r, e = g // el, g % el
                if r in zero_owners:
                    continue
                j = sum(g in idx[s, u] for u in range(t))
                row = model[r]["first_row"][e, s] + j
                acc = acc + np.float32(w[s, t, k]) * ys[r][e, row].astype(np.float32)
            out[t] = acc.astype(ys[0].dtype)
        outs.append(out)
    return outs


def routing(rng, kind, Tn=T):
    if kind == "masked":
        return np.full((R, Tn, K), -1, np.int32)
    if kind == "skewed":  # every token names experts 0..K-1: rank 0 owns all rows
        idx = np.broadcast_to(np.arange(K, dtype=np.int32), (R, Tn, K)).copy()
        idx[:, ::2, -1] = -1
        return idx
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(Tn)])
                    for _ in range(R)]).astype(np.int32)
    return np.where(rng.random((R, Tn, K)) < 0.25, -1, idx).astype(np.int32)


def make_calls(seed, kinds, dtype=np.float32, Tn=T, order="paired", loop=False):
    """Programs of repeated dispatches and combines, plus the model's results per call:
    (programs, want) with want[i] = (model, outs, dispatch Calls, combine Calls).
    order: "paired" D0 C0 D1 C1 ...; "batched" D0 D1 ... C0 C1 ...; "overlapped": two
    send halves of one kind in flight, then their receive halves (as the FP8 dispatch's
    values and scales); "swapped": the same with the receive halves in reverse order.
    Without two sends in flight, the other calls' waits already order every rank, so only
    the overlapped orders need the credits. loop: every iteration has the same call
    sites, as one compiled call in a scan over decode steps (only epochs tell calls
    apart)."""
    rng = np.random.default_rng(seed)
    want = []
    for i, kind in enumerate(kinds):
        x = rng.standard_normal((R, Tn, H)).astype(dtype)
        idx = routing(rng, kind, Tn)
        w = rng.random((R, Tn, K)).astype(np.float32)
        ys = [rng.standard_normal((E // R, R * M, H)).astype(dtype) for _ in range(R)]
        model = np_dispatch(x, idx, E, M)
        outs = np_combine(ys, idx, w, model)
        site = 1 if loop else 2 * i + 1
        ds = [S.Call("dispatch", x=x[r], idx=idx[r], site=site) for r in range(R)]
        cs = [S.Call("combine", y=ys[r], idx=idx[r], w=w[r], first_row=model[r]["first_row"],
                     row_count=model[r]["row_count"], site=site + 1) for r in range(R)]
        want.append((model, outs, ds, cs))
    programs = []
    for r in range(R):
        d = [wt[2][r] for wt in want]
        c = [wt[3][r] for wt in want]
        if order == "paired":
            prog = [x for pair in zip(d, c) for x in pair]
        elif order == "batched":
            prog = d + c
        elif order in ("overlapped", "swapped"):
            prog = []
            for calls in (d, c):
                for j in range(0, len(calls), 2):
                    two = calls[j:j + 2]
                    prog += [("send", k) for k in two]
                    prog += [("recv", k) for k in (two[::-1] if order == "swapped" else two)]
        else:
            raise ValueError(order)
        programs.append(prog)
    return programs, want


def check(world, want):
    assert world.findings == [], world.findings[:3]
    for rk in world.ranks:
        assert rk.error is None, rk.error
        assert len(rk.results) == 2 * len(want)
        for i, (model, outs, ds, cs) in enumerate(want):
            got = rk.by_call[id(ds[rk.me])]
            for key, v in model[rk.me].items():
                np.testing.assert_array_equal(got[key].view(np.uint8) if key == "recv"
                                              else got[key],
                                              v.view(np.uint8) if key == "recv" else v,
                                              err_msg=f"rank {rk.me} call {i} {key}")
            np.testing.assert_array_equal(rk.by_call[id(cs[rk.me])]["out"].view(np.uint8),
                                          outs[rk.me].view(np.uint8))


# --- correct protocol -----------------------------------------------------------------

@pytest.mark.parametrize("order", ["paired", "batched", "overlapped", "swapped"])
@pytest.mark.parametrize("seed", range(3))
def test_repeated_calls_match_model_in_random_orders(seed, order):
    programs, want = make_calls(seed, ["random", "skewed", "masked", "random"], order=order,
                                loop=seed % 2 == 1)
    check(S.simulate(SETUP, programs, seed=seed), want)


def test_a_third_send_in_flight_times_out_instead_of_overwriting():
    """Two data halves: a third send half of one kind before the first receive half waits
    for a credit only that receive half gives, and is reported, not overwriting."""
    programs, _ = make_calls(8, ["random"] * 3)
    programs = [[("send", c) for c in p[0::2][:3]] + [("recv", c) for c in p[0::2][:3]]
                for p in programs]
    w = S.simulate(SETUP, programs, seed=8, timeout=200)
    assert w.findings == []
    assert all(rk.error is not None and rk.error[0] in (S.ERR_TIMEOUT, S.ERR_PEER_FAILED)
               for rk in w.ranks)
    assert any(rk.error[2] == "dispatch credit" for rk in w.ranks
               if rk.error[0] == S.ERR_TIMEOUT)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fewer_tokens_and_half_precision(dtype):
    programs, want = make_calls(7, ["random", "random"], dtype=dtype, Tn=2)
    check(S.simulate(SETUP, programs, seed=7), want)


def test_index_math_is_the_compiled_one():
    from jax_ep import _ext
    ext = _ext.ext
    if ext is None or not hasattr(ext, "cuda_ll_slot"):
        pytest.skip("no CUDA host functions in this build (kernels/common/low_latency_math.h "
                    "is reached through them)")
    for e, s, p, Rn, Mn in [(0, 0, 0, 4, 6), (1, 3, 5, 4, 6), (3, 7, 2, 8, 128)]:
        assert ext.cuda_ll_slot(e, s, p, Rn, Mn) == S.slot_index(e, s, p, Rn, Mn)
    col = np.array([3, 0, 2, 5], np.int32)
    for e in range(4):
        assert ext.cuda_ll_stage_row(e, 1, list(col)) == S.stage_row(e, 1, col)
    for seq, n in [(1, 1), (5, 4), (2**31 + 3, 2**31 + 1), (2**40, 2**40 - 2)]:
        low = n & S.EPOCH_MASK
        assert ext.cuda_ll_epoch_from_low(seq, low) == S.epoch_from_low(seq, low) == n


# --- faults the protocol reports ------------------------------------------------------

def test_absent_rank_times_out_everywhere_without_hang():
    programs, _ = make_calls(3, ["random", "random"])
    programs[2] = None  # never runs
    w = S.simulate(SETUP, programs, seed=3, timeout=200)
    assert w.findings == []
    for rk in w.ranks:
        if rk.me == 2:
            continue
        assert rk.error is not None and rk.error[0] in (S.ERR_TIMEOUT, S.ERR_PEER_FAILED)
        assert any(rk.error[0] == S.ERR_TIMEOUT for rk in w.ranks if rk.me != 2)


def test_a_rank_with_other_shapes_errors_instead_of_mixing():
    programs, _ = make_calls(4, ["random"])
    c = programs[1][0]
    programs[1][0] = S.Call("dispatch", x=c.x[:, :H // 2].copy(), idx=c.idx, site=c.site)
    w = S.simulate(SETUP, programs, seed=4)
    assert w.findings == []
    codes = {rk.me: rk.error[0] for rk in w.ranks}
    assert set(codes.values()) <= {S.ERR_CALL_SITE, S.ERR_PEER_FAILED}
    assert codes[1] == S.ERR_CALL_SITE


def test_a_skipped_call_is_a_site_mismatch():
    programs, _ = make_calls(5, ["random", "random"])
    programs[3] = programs[3][2:]  # rank 3 runs call 2 while the others run call 1
    w = S.simulate(SETUP, programs, seed=5, timeout=300)
    assert w.findings == []
    assert all(rk.error is not None for rk in w.ranks)
    assert w.ranks[3].error[0] in (S.ERR_CALL_SITE, S.ERR_PEER_FAILED, S.ERR_TIMEOUT)


def _foreign_handle_programs():
    """Rank 1's first combine gets a handle that does not fit its y."""
    programs, want = make_calls(10, ["random", "random"])
    model, _, ds, cs = want[0]
    bad = cs[1]
    rc = bad.row_count.copy()
    rc[0, 0] = R * M + 1  # a row count beyond y: not this dispatch's handle
    programs[1] = [x if x is not bad else S.Call("combine", y=bad.y, idx=bad.idx, w=bad.w,
                                                 first_row=bad.first_row, row_count=rc,
                                                 site=bad.site)
                   for x in programs[1]]
    return programs, want, model, cs


def test_foreign_combine_handle_counts_as_zero_everywhere_and_is_not_sticky():
    programs, want, model, cs = _foreign_handle_programs()
    w = S.simulate(SETUP, programs, seed=10)
    assert w.findings == []
    assert all(rk.error[0] == S.ERR_BAD_HANDLE for rk in w.ranks)
    idx = np.stack([c.idx for c in cs])
    wts = np.stack([c.w for c in cs])
    zeroed = np_combine([c.y for c in cs], idx, wts, model, zero_owners=(1,))
    for rk in w.ranks:
        got = rk.results[1]["out"]
        np.testing.assert_array_equal(got.view(np.uint8), zeroed[rk.me].view(np.uint8))
        for key, v in want[1][0][rk.me].items():  # the next call is exact again
            np.testing.assert_array_equal(rk.results[2][key], v)
        np.testing.assert_array_equal(rk.results[3]["out"], want[1][1][rk.me])


def test_bad_id_is_reported_and_others_finish():
    programs, _ = make_calls(6, ["random"])
    idx = programs[0][0].idx.copy()
    idx[1, 0] = E + 2
    programs[0][0] = S.Call("dispatch", x=programs[0][0].x, idx=idx, site=1)
    w = S.simulate(SETUP, programs, seed=6)
    assert w.findings == []
    assert w.ranks[0].error[:4] == (S.ERR_BAD_ID, 1, 0, E + 2)
    assert all(rk.error is None for rk in w.ranks[1:])


# --- planted mistakes, each caught ----------------------------------------------------

def _planted(plant, seeds=range(6), order="overlapped", **kw):
    """(findings, wrong results) over several interleavings with `plant` switched on."""
    caught = []
    for seed in seeds:
        programs, want = make_calls(seed, ["random", "skewed", "random", "random"],
                                    order=order, loop=True)
        try:
            w = S.simulate(SETUP, programs, seed=seed, plant=(plant,), **kw)
        except S.Hang as h:
            caught.append(f"hang: {h}")
            continue
        try:
            check(w, want)
        except AssertionError as a:
            caught.append(str(a)[:300])
    return caught


@pytest.mark.parametrize("plant", ["no_dispatch_credit", "no_combine_credit",
                                   "credit_before_read", "flag_before_data", "stale_epoch",
                                   "single_half"])
def test_planted_ordering_mistake_is_caught(plant):
    caught = _planted(plant)
    assert caught, f"{plant} went unnoticed"


def test_planted_latest_epoch_mixes_up_calls_received_out_of_order():
    caught = _planted("latest_epoch", order="swapped")
    assert caught


def test_planted_missing_credit_is_an_unread_overwrite():
    programs, _ = make_calls(1, ["skewed"] * 4, order="overlapped")
    hits = []
    for seed in range(6):
        w = S.simulate(SETUP, programs, seed=seed, plant=("no_dispatch_credit",))
        hits += [f for f in w.findings if f.startswith("overwrote unread")]
    assert hits


def test_planted_wait_without_timeout_hangs():
    programs, _ = make_calls(2, ["random"])
    programs[1] = None
    with pytest.raises(S.Hang):
        S.simulate(SETUP, programs, seed=2, plant=("no_timeout",), hang_limit=3000)


def test_planted_missing_config_check_mixes_shapes():
    programs, _ = make_calls(4, ["random"])
    c = programs[1][0]
    programs[1][0] = S.Call("dispatch", x=c.x[:, :H // 2].copy(), idx=c.idx, site=c.site)
    w = S.simulate(SETUP, programs, seed=4, plant=("no_config_check",))
    assert any(f.startswith("mixed configs") for f in w.findings)


def test_planted_silent_bad_handle_reads_unwritten_rows():
    programs, _, _, _ = _foreign_handle_programs()
    w = S.simulate(SETUP, programs, seed=10, plant=("silent_bad_handle",))
    assert any(f.startswith("read before written/stale") for f in w.findings)


def test_unknown_plant_is_rejected():
    with pytest.raises(ValueError, match="unknown planted"):
        S.World(SETUP, plant=("nope",))


# --- a repeated id, a value error before a timeout, an overflowing handle ---------------

def _repeated_id_programs(seed=11):
    """Rank 0's token 1 names one expert twice: the dispatch leaves the repeat unused (and
    reports it), the combine skips it too. Returns (programs, model, outs) where the model
    is that of the routing without the repeat."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = routing(rng, "random")
    # Token 1 of rank 0 names g in slots 0 and 1; a later token also names g, so a repeat
    # counted by mistake shifts that token's row.
    g = 1
    idx[0, 1, :] = [g, (g + 1) % E, -1]
    idx[0, 3, :] = [(g + 2) % E, g, -1]
    clean = idx.copy()
    dup = idx.copy()
    dup[0, 1, 2] = g  # the repeat
    w = rng.random((R, T, K)).astype(np.float32)
    ys = [rng.standard_normal((E // R, R * M, H)).astype(np.float32) for _ in range(R)]
    model = np_dispatch(x, clean, E, M)
    outs = np_combine(ys, clean, w, model)
    programs = [[S.Call("dispatch", x=x[r], idx=dup[r], site=1),
                 S.Call("combine", y=ys[r], idx=dup[r], w=w[r],
                        first_row=model[r]["first_row"], row_count=model[r]["row_count"],
                        site=2)] for r in range(R)]
    return programs, model, outs


def test_repeated_id_is_reported_and_left_out_of_dispatch_and_combine():
    programs, model, outs = _repeated_id_programs()
    w = S.simulate(SETUP, programs, seed=11)
    assert w.findings == []
    assert w.ranks[0].error[:4] == (S.ERR_BAD_ID, 1, 2, 1)
    assert all(rk.error is None for rk in w.ranks[1:])
    for rk in w.ranks:
        for key, v in model[rk.me].items():
            np.testing.assert_array_equal(rk.results[0][key], v, err_msg=key)
        np.testing.assert_array_equal(rk.results[1]["out"].view(np.uint8),
                                      outs[rk.me].view(np.uint8))


def test_planted_combine_counting_repeats_reads_other_rows():
    programs, model, outs = _repeated_id_programs()
    w = S.simulate(SETUP, programs, seed=11, plant=("combine_counts_repeats",))
    wrong = w.findings != [] or not np.array_equal(w.ranks[0].results[1]["out"], outs[0])
    assert wrong


def _value_error_then_third_send(plant=()):
    """Rank 0's first dispatch has a bad id (a value error, recorded first), then every
    rank sends a third dispatch before any receive half: the credit wait times out."""
    programs, _ = make_calls(8, ["random"] * 3)
    idx = programs[0][0].idx.copy()
    idx[0, 0] = E + 5
    programs[0][0] = S.Call("dispatch", x=programs[0][0].x, idx=idx, site=programs[0][0].site)
    programs = [[("send", c) for c in p[0::2][:3]] + [("recv", c) for c in p[0::2][:3]]
                for p in programs]
    return S.simulate(SETUP, programs, seed=8, timeout=200, plant=plant)


def test_timeout_after_a_value_error_still_stops_the_send():
    w = _value_error_then_third_send()
    assert w.findings == []
    assert w.ranks[0].error[0] == S.ERR_BAD_ID  # the record keeps the first error
    assert all(rk.protocol_failed for rk in w.ranks)


def test_planted_masked_failure_overwrites_unread_slots():
    w = _value_error_then_third_send(plant=("masked_failure",))
    assert any(f.startswith("overwrote unread") for f in w.findings)


@pytest.mark.parametrize("first,count", [(2**31 - 1, 1), (2**31 - 2, 2**31 - 1)])
def test_handle_whose_end_passes_int32_is_foreign(first, count):
    """first_row + row_count above 2^31 wraps in int32; the check runs in int64."""
    programs, want = make_calls(12, ["random"])
    bad = programs[2][1]
    fr, rc = bad.first_row.copy(), bad.row_count.copy()
    fr[0, 1], rc[0, 1] = first, count
    programs[2][1] = S.Call("combine", y=bad.y, idx=bad.idx, w=bad.w, first_row=fr,
                            row_count=rc, site=bad.site)
    w = S.simulate(SETUP, programs, seed=12)
    assert w.findings == []
    assert all(rk.error[0] == S.ERR_BAD_HANDLE for rk in w.ranks)


def test_handle_above_the_calls_rows_per_source_is_foreign():
    """The owner checks rows per source against the call's M * min(K, E_local), as the
    CPU does, not only against the area's."""
    programs, want = make_calls(13, ["skewed"])
    c = programs[0][1]
    most = int(c.row_count.sum(axis=0).max())
    assert most > 1
    programs[0][1] = S.Call("combine", y=c.y, idx=c.idx, w=c.w, first_row=c.first_row,
                            row_count=c.row_count, site=c.site, rows_per_dest=most - 1)
    w = S.simulate(SETUP, programs, seed=13)
    assert w.findings == []
    assert all(rk.error[0] == S.ERR_BAD_HANDLE for rk in w.ranks)


def test_a_call_beyond_the_area_stops_that_rank_and_its_peers_time_out():
    """The handler rejects a call the area cannot hold before launching anything, and XLA
    stops that rank's program: it takes no epoch and signals nothing, so its peers end in
    bounded timeouts (not a hang), and nothing is read or overwritten."""
    programs, _ = make_calls(14, ["random", "random"])
    c = programs[2][0]
    wide = np.concatenate([c.x, c.x], axis=1)  # rows wider than setup's H
    programs[2][0] = S.Call("dispatch", x=wide, idx=c.idx, site=c.site)
    w = S.simulate(SETUP, programs, seed=14, timeout=200)
    assert w.findings == []
    assert w.ranks[2].error[0] == S.ERR_AREA and w.ranks[2].results == []
    assert w.bufs[2].seq == {"d": 0, "c": 0}
    for rk in w.ranks:
        if rk.me != 2:
            assert rk.error[0] in (S.ERR_TIMEOUT, S.ERR_PEER_FAILED), rk.error
    assert any(rk.error[0] == S.ERR_TIMEOUT for rk in w.ranks if rk.me != 2)


def test_a_combine_with_other_rows_per_source_is_a_mismatch():
    """rows_per_dest (M * min(K, E_local) of the dispatch that made the handle) is part of
    the combine's call tag, as in the handler: an owner whose call was built for another K
    is reported, its rows never mixed in."""
    programs, _ = make_calls(15, ["random"])
    c = programs[3][1]
    assert int(c.row_count.sum(axis=0).max()) <= M  # the handle fits the smaller call
    programs[3][1] = S.Call("combine", y=c.y, idx=c.idx, w=c.w, first_row=c.first_row,
                            row_count=c.row_count, site=c.site,
                            rows_per_dest=SETUP.rows_per_dest - M)
    w = S.simulate(SETUP, programs, seed=15)
    assert w.findings == []
    assert all(rk.error is not None and rk.error[0] in (S.ERR_CALL_SITE, S.ERR_PEER_FAILED)
               for rk in w.ranks)
    assert any(rk.error[0] == S.ERR_CALL_SITE for rk in w.ranks)


def test_combine_routing_with_a_repeated_id_is_reported_on_that_source():
    """The CPU's combine rejects a repeated id; here the source reports it and leaves the
    repeat out (the dispatch, with clean routing, gave it no row): every other output is
    exact, and the token sums its first slot only."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = routing(rng, "random")
    idx[2, 0, :] = [3, 5, -1]
    w = rng.random((R, T, K)).astype(np.float32)
    ys = [rng.standard_normal((E // R, R * M, H)).astype(np.float32) for _ in range(R)]
    model = np_dispatch(x, idx, E, M)
    outs = np_combine(ys, idx, w, model)
    dup = idx.copy()
    dup[2, 0, 2] = 5  # only in the combine's routing
    programs = [[S.Call("dispatch", x=x[r], idx=idx[r], site=1),
                 S.Call("combine", y=ys[r], idx=dup[r], w=w[r],
                        first_row=model[r]["first_row"], row_count=model[r]["row_count"],
                        site=2)] for r in range(R)]
    w_ = S.simulate(SETUP, programs, seed=16)
    assert w_.findings == []
    assert w_.ranks[2].error[:4] == (S.ERR_BAD_ID, 0, 2, 5)
    assert all(rk.error is None for rk in w_.ranks if rk.me != 2)
    for rk in w_.ranks:
        np.testing.assert_array_equal(rk.results[1]["out"].view(np.uint8),
                                      outs[rk.me].view(np.uint8))
