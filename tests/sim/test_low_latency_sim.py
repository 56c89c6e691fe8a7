"""The internode low-latency protocol on the host simulator (tests/sim/low_latency_sim.py):
exact results against a NumPy model of the contract at several shapes, QP striping,
faults ending in errors on every rank, and each planted mistake reported."""
import numpy as np
import pytest

from low_latency_sim import Mistakes, Sim


# --- a NumPy model of the contract (docs/low_latency.md), independent of the protocol ----

def model_dispatch(xs, idxs, E, M):
    """Per owner: recv_x[E_local, R*M, H], recv_count, src_rank, src_index, and the list
    of (source, token) of each expert's rows."""
    R = len(xs)
    el, H = E // R, xs[0].shape[1]
    outs = []
    for r in range(R):
        recv_x = np.zeros((el, R * M, H), np.float32)
        src_rank = np.full((el, R * M), -1, np.int32)
        src_index = np.full((el, R * M), -1, np.int32)
        lists = []
        for e in range(el):
            g = r * el + e
            rows = []
            for s in range(R):
                toks = [t for t in range(idxs[s].shape[0]) if g in idxs[s][t]]
                rows += [(s, t) for t in toks[:M]]  # past M a source's rows are dropped
            for i, (s, t) in enumerate(rows):
                recv_x[e, i], src_rank[e, i], src_index[e, i] = xs[s][t], s, t
            lists.append(rows)
        outs.append(dict(recv_x=recv_x, recv_count=np.array([len(l) for l in lists], np.int32),
                         src_rank=src_rank, src_index=src_index, rows=lists))
    return outs


def model_combine(ys, idxs, ws, disp, E):
    """out_s[t] = sum over k ascending of w[t, k] * (owner's y row of (s, t) for that
    expert), float32 products rounded, then added."""
    R = len(ys)
    el, H = E // R, ys[0].shape[-1]
    outs = []
    for s in range(R):
        S, K = idxs[s].shape
        out = np.zeros((S, H), np.float32)
        for t in range(S):
            acc = np.zeros(H, np.float32)
            for k in range(K):
                g = int(idxs[s][t, k])
                if g < 0:
                    continue
                rows = disp[g // el]["rows"][g % el]
                if (s, t) not in rows:
                    continue  # dropped at dispatch (past M)
                v = ys[g // el][g % el, rows.index((s, t))]
                acc = (acc + (np.float32(ws[s][t, k]) * v).astype(np.float32)).astype(np.float32)
            out[t] = acc
        outs.append(out)
    return outs


def routing(rng, R, E, M, K, T=None, pad_to=None):
    """Per rank idx[S, K]: T <= M tokens with K distinct experts or -1, padded with -1
    rows to `pad_to` (M by default, as the Python layer stages them)."""
    pad_to = M if pad_to is None else pad_to
    out = []
    for _ in range(R):
        t = int(rng.integers(0, M + 1)) if T is None else T
        idx = np.full((pad_to, K), -1, np.int32)
        for i in range(t):
            n = int(rng.integers(0, min(K, E) + 1))
            idx[i, :n] = rng.choice(E, n, replace=False)
            rng.shuffle(idx[i])
        out.append(idx)
    return out


def round_data(rng, R, E, M, K, H):
    """x[M, H], idx[M, K] and weights[M, K] per rank."""
    xs = [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)]
    idxs = routing(rng, R, E, M, K)
    ws = [rng.standard_normal((M, K)).astype(np.float32) for _ in range(R)]
    return xs, idxs, ws


def run_rounds(R, E, M, K, H, *, P=2, Q=2, rounds=3, seed=0, mistakes=Mistakes(),
               depth2=False, reorder=True, slow=None, policy="random", first_epoch=0,
               timeout=5000):
    """`rounds` dispatch + combine rounds on every rank (with `depth2`, two dispatch sends
    before their receives, as the FP8 dispatch does); y = 2 * recv_x + rank. `slow`:
    (rank, steps) sleeps before each of that rank's receives. Returns (Result, model
    outputs)."""
    rng = np.random.default_rng(seed)
    el = E // R
    rpd = M * min(K, el)
    data = [round_data(rng, R, E, M, K, H) for i in range(rounds)]
    want_d = [model_dispatch(xs, idxs, E, M) for xs, idxs, _ in data]
    ys = [[(2 * want_d[i][r]["recv_x"] + r).astype(np.float32) for r in range(R)]
          for i in range(rounds)]
    # y rows past the count are never sent: garbage there must not matter
    for i in range(rounds):
        for r in range(R):
            for e in range(el):
                ys[i][r][e, want_d[i][r]["recv_count"][e]:] = 1e30
    want_c = [model_combine(ys[i], data[i][1], data[i][2], want_d[i], E) for i in range(rounds)]

    def sleep(r):
        return [{"do": "sleep", "steps": slow[1]}] if slow and slow[0] == r else []

    steps = []
    for r in range(R):
        st = []
        i = 0
        while i < rounds:
            group = [i, i + 1] if depth2 and i + 1 < rounds else [i]
            for j in group:
                st.append({"do": "dispatch_send", "x": data[j][0][r], "idx": data[j][1][r],
                           "name": f"d{j}"})
            for j in group:
                st += sleep(r) + [{"do": "dispatch_recv", "name": f"d{j}"}]
            for j in group:
                h = want_d[j][r]
                first = np.zeros((el, R), np.int32)
                count = np.zeros((el, R), np.int32)
                for e in range(el):
                    srcs = [s for s, _ in h["rows"][e]]
                    for s in range(R):
                        count[e, s] = srcs.count(s)
                    first[e] = np.cumsum(count[e]) - count[e]
                st.append({"do": "combine_send", "y": ys[j][r], "first_row": first,
                           "row_count": count, "rows_per_dest": rpd, "name": f"c{j}"})
                st += sleep(r) + [{"do": "combine_recv", "name": f"c{j}", "idx": data[j][1][r],
                                   "w": data[j][2][r], "rows_per_dest": rpd}]
            i += len(group)
        steps.append(st)
    sim = Sim(R, E, M, H, num_ports=P, qps_per_port=Q, seed=seed, reorder=reorder,
              policy=policy, mistakes=mistakes, first_epoch=first_epoch, timeout=timeout)
    return sim.simulate(steps), want_d, want_c, depth2


def outputs_of(res, r):
    """(dispatch outputs per round, combine outputs per round) of rank r."""
    outs = [o for o in res.outputs[r] if o is not None]
    d, c = [], []
    for o in outs:
        (d if isinstance(o, tuple) else c).append(o)
    return d, c


def check_exact(res, want_d, want_c, R):
    for r in range(R):
        d, c = outputs_of(res, r)
        assert len(d) == len(want_d) and len(c) == len(want_c)
        for i in range(len(want_d)):
            recv_x, count, src_rank, src_index, first_row, row_count = d[i]
            w = want_d[i][r]
            np.testing.assert_array_equal(recv_x.view(np.uint32), w["recv_x"].view(np.uint32))
            np.testing.assert_array_equal(count, w["recv_count"])
            np.testing.assert_array_equal(src_rank, w["src_rank"])
            np.testing.assert_array_equal(src_index, w["src_index"])
            np.testing.assert_array_equal(row_count.sum(1), w["recv_count"])
            np.testing.assert_array_equal(first_row, np.cumsum(row_count, 1) - row_count)
            np.testing.assert_array_equal(c[i].view(np.uint32), want_c[i][r].view(np.uint32))


# 2 to 4 ranks, K > E_local and consecutive rounds run on the kernels themselves
# (tests/emu/test_internode_ll_emu.py)
SHAPES = [  # R, E, M, K, H, ports, QPs per port
    (8, 16, 3, 4, 2, 2, 2),
    (4, 4, 6, 1, 2, 1, 3),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed,policy", [(0, "random"), (1, "random"), (2, "lazy")])
def test_exact_against_model(shape, seed, policy):
    R, E, M, K, H, P, Q = shape
    res, want_d, want_c, _ = run_rounds(R, E, M, K, H, P=P, Q=Q, rounds=3, seed=seed,
                                        policy=policy)
    assert res.violations == [] and not res.hang
    assert res.errors == [None] * R
    check_exact(res, want_d, want_c, R)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_sends_in_flight_and_slow_reader(seed):
    """The FP8 dispatch's pattern (two sends, then two receives) with one rank slow to
    read: the credits hold the third epoch back until buffer 1 is free again."""
    R, E, M, K, H = 4, 8, 4, 2, 2
    res, want_d, want_c, _ = run_rounds(R, E, M, K, H, rounds=4, seed=seed, depth2=True,
                                        slow=(1, 300))
    assert res.violations == [] and not res.hang
    assert res.errors == [None] * R
    check_exact(res, want_d, want_c, R)


def test_fifo_qps_and_one_slot_gradient_staging():
    """QPs delivering in order, and the gradient's staging: M * K one-slot tokens."""
    R, E, M, K, H = 4, 8, 3, 3, 2
    rng = np.random.default_rng(5)
    idxs = routing(rng, R, E, M, K, T=M)
    one = [np.where(i >= 0, i, -1).reshape(M * K, 1) for i in idxs]
    xs = [rng.standard_normal((M * K, H)).astype(np.float32) for _ in range(R)]
    want = model_dispatch(xs, one, E, M)
    sim = Sim(R, E, M, H, seed=3, reorder=False)
    res = sim.simulate([[{"do": "dispatch_send", "x": xs[r], "idx": one[r], "name": "g"},
                         {"do": "dispatch_recv", "name": "g"}] for r in range(R)])
    assert res.violations == [] and res.errors == [None] * R
    for r in range(R):
        got = res.outputs[r][1]
        np.testing.assert_array_equal(got[0], want[r]["recv_x"])
        np.testing.assert_array_equal(got[3], want[r]["src_index"])


def test_rows_striped_over_ports():
    """Each (source, owner) stream's rows are spread over the ports within one row, and
    every word has one writer QP (the simulator checks the latter on every signal)."""
    R, E, M, K, H, P, Q = 4, 4, 8, 4, 1, 2, 2
    rng = np.random.default_rng(0)
    idxs = routing(rng, R, E, M, K, T=M)
    xs = [np.ones((M, H), np.float32) for _ in range(R)]
    sim = Sim(R, E, M, H, num_ports=P, qps_per_port=Q, seed=0)
    res = sim.simulate([[{"do": "dispatch_send", "x": xs[r], "idx": idxs[r], "name": "d"},
                         {"do": "dispatch_recv", "name": "d"}] for r in range(R)])
    assert res.violations == []
    streams = 0
    for s in range(R):
        for d in range(R):
            per_port = [res.port_rows.get((s, d, p), 0) for p in range(P)]
            if sum(per_port) > 1:
                streams += 1
                assert max(per_port) - min(per_port) <= 1, (s, d, per_port)
    assert streams > 0


# --- faults -------------------------------------------------------------------------

def _one_dispatch(R, E, M, K, H, *, seed=0, mutate=None, mistakes=Mistakes(), timeout=2000):
    rng = np.random.default_rng(seed)
    idxs = routing(rng, R, E, M, K, T=M)
    xs = [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)]
    steps = [[{"do": "dispatch_send", "x": xs[r], "idx": idxs[r], "name": "d"},
              {"do": "dispatch_recv", "name": "d"}] for r in range(R)]
    if mutate:
        mutate(steps)
    sim = Sim(R, E, M, H, seed=seed, timeout=timeout, mistakes=mistakes)
    return sim.simulate(steps)


def test_bad_id_fails_every_rank():
    def bad(st):
        st[1][0]["idx"] = st[1][0]["idx"].copy()
        st[1][0]["idx"][0, 0] = 99
    res = _one_dispatch(4, 8, 3, 2, 2, mutate=bad)
    assert res.errors[1]["code"] == "bad_id" and res.errors[1]["value"] == 99
    for r in (0, 2, 3):
        assert res.errors[r] == {"code": "peer_failed", "peer": 1, "rank": r}
    assert res.violations == []


def test_other_shape_is_a_mismatch_on_every_rank():
    def other(st):
        st[3][0]["x"] = np.zeros((3, 5), np.float32)  # H = 5 instead of 2
    res = _one_dispatch(4, 8, 3, 2, 2, mutate=other)
    for r in range(4):
        assert res.errors[r]["code"] == "mismatch", res.errors[r]
    assert res.errors[0]["peer"] == 3 and res.errors[3]["peer"] == 0


def test_combine_with_another_routing_is_an_error():
    R, E, M, K, H = 4, 8, 4, 2, 2
    # one source passes other ids to combine_recv than the ones it dispatched
    rng = np.random.default_rng(4)
    xs, idxs, ws = round_data(rng, R, E, M, K, H)
    d = model_dispatch(xs, idxs, E, M)
    steps = []
    for r in range(R):
        el = E // R
        count = np.array([[[s for s, _ in d[r]["rows"][e]].count(s) for s in range(R)]
                          for e in range(el)], np.int32)
        first = (np.cumsum(count, 1) - count).astype(np.int32)
        idx = idxs[r] if r != 2 else np.full_like(idxs[r], -1)
        steps.append([{"do": "combine_send", "y": d[r]["recv_x"], "first_row": first,
                       "row_count": count, "rows_per_dest": M * min(K, el), "name": "c"},
                      {"do": "combine_recv", "name": "c", "idx": idx, "w": ws[r],
                       "rows_per_dest": M * min(K, el)}])
    assert any(s == 2 for o in range(R) for e in range(E // R) for s, _ in d[o]["rows"][e])
    res2 = Sim(R, E, M, H, seed=1).simulate(steps)
    assert res2.errors[2]["code"] == "rows_mismatch", res2.errors[2]
    assert [res2.errors[r] for r in (0, 1, 3)] == [None] * 3


# --- planted mistakes -----------------------------------------------------------------

def _caught(res):
    return bool(res.violations) or res.hang or any(e is not None for e in res.errors)


@pytest.mark.parametrize("mistake", [False, True])
def test_planted_signal_before_data_is_caught(mistake):
    """Operations land as late as possible ("lazy"): a reader woken by a signal that
    went out ahead of its row reads the row before it lands."""
    hits = 0
    for seed in range(4):
        res, want_d, want_c, _ = run_rounds(4, 8, 4, 2, 2, rounds=1, seed=seed, policy="lazy",
                                            mistakes=Mistakes(signal_before_data=mistake))
        hits += any("row" in v and "before it landed" in v for v in res.violations)
        if not mistake:
            check_exact(res, want_d, want_c, 4)
    assert (hits > 0) == mistake


def test_planted_shared_signal_word_is_caught():
    res, *_ = run_rounds(4, 8, 4, 3, 2, P=2, Q=2, rounds=1,
                         mistakes=Mistakes(shared_signal_word=True))
    assert any("more than one QP" in v for v in res.violations)


def _slow_writer_steps(rounds, slow_rank, R, E, M, K, H, seed):
    """Dispatch-only rounds; `slow_rank` sleeps before each of its sends after the
    first, so its readers reach their receive before its header lands."""
    rng = np.random.default_rng(seed)
    data = [(routing(rng, R, E, M, K, T=M),
             [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)])
            for _ in range(rounds)]
    steps = []
    for r in range(R):
        st = []
        for i, (idxs, xs) in enumerate(data):
            if r == slow_rank and i > 0:
                st.append({"do": "sleep", "steps": 400})
            st += [{"do": "dispatch_send", "x": xs[r], "idx": idxs[r], "name": f"d{i}"},
                   {"do": "dispatch_recv", "name": f"d{i}"}]
        steps.append(st)
    return steps, data


@pytest.mark.parametrize("mistake", [None, "no_epoch_check"])
def test_planted_missing_epoch_check_accepts_a_stale_header(mistake):
    R, E, M, K, H = 4, 8, 3, 2, 2
    steps, _ = _slow_writer_steps(3, 0, R, E, M, K, H, seed=0)
    m = Mistakes(no_epoch_check=True) if mistake else Mistakes()
    res = Sim(R, E, M, H, seed=0, timeout=5000, mistakes=m).simulate(steps)
    stale = [v for v in res.violations if "header" in v and "before it landed" in v]
    if mistake:
        assert stale, res.violations
    else:
        assert res.violations == [] and res.errors == [None] * R


def _slow_reader_steps(R, E, M, K, H, seed, depth2):
    rng = np.random.default_rng(seed)
    rounds = 4 if depth2 else 3
    data = [(routing(rng, R, E, M, K, T=M),
             [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)])
            for _ in range(rounds)]
    steps = []
    for r in range(R):
        st = []
        groups = [[0, 1], [2, 3]] if depth2 else [[0], [1], [2]]
        for g in groups:
            for i in g:
                st.append({"do": "dispatch_send", "x": data[i][1][r], "idx": data[i][0][r],
                           "name": f"d{i}"})
            for i in g:
                if r == 0:
                    st.append({"do": "sleep", "steps": 600})
                st.append({"do": "dispatch_recv", "name": f"d{i}"})
        steps.append(st)
    return steps


@pytest.mark.parametrize("mistake,depth2", [(None, False), (None, True),
                                            ("single_buffer", False), ("no_credit", True)])
def test_planted_slot_reuse_without_double_buffer_or_credit(mistake, depth2):
    """Rank 0 reads late. One buffer without credits lets the next epoch overwrite the
    rows it has not read; two buffers without credits fail the same way once two sends
    are in flight. With both (the protocol) nothing is overwritten."""
    R, E, M, K, H = 4, 4, 4, 2, 2
    steps = _slow_reader_steps(R, E, M, K, H, 0, depth2)
    m = Mistakes(**{mistake: True}) if mistake else Mistakes()
    res = Sim(R, E, M, H, seed=0, timeout=5000, mistakes=m).simulate(steps)
    early = [v for v in res.violations if "slot reused early" in v]
    if mistake:
        assert early, res.violations
    else:
        assert res.violations == [] and res.errors == [None] * R


def test_planted_wrong_row_order_is_caught():
    R, E, M, K, H = 4, 8, 4, 3, 2
    res, want_d, want_c, _ = run_rounds(R, E, M, K, H, rounds=1, seed=0,
                                        mistakes=Mistakes(wrong_row_order=True))
    with pytest.raises(AssertionError):
        check_exact(res, want_d, want_c, R)


def test_planted_missing_timeout_hangs_and_is_reported():
    skip = lambda st: st[2].clear()  # noqa: E731
    res = _one_dispatch(4, 8, 3, 2, 2, mutate=skip, mistakes=Mistakes(no_timeout=True))
    assert res.hang and any(v.startswith("hang") for v in res.violations)
    ok = _one_dispatch(4, 8, 3, 2, 2, mutate=skip)
    assert not ok.hang and _caught(ok)


@pytest.mark.parametrize("mistake", [False, True])
def test_planted_credit_before_reset_loses_increments(mistake):
    """The reader must reset its data words before it returns the credit: otherwise a
    fast writer's next rows into that buffer land in a word about to be reset."""
    R, E, M, K, H = 4, 4, 4, 2, 2
    hits = 0
    for seed in range(6):
        steps = _slow_reader_steps(R, E, M, K, H, seed, True)
        res = Sim(R, E, M, H, seed=seed, timeout=3000,
                  mistakes=Mistakes(credit_before_reset=mistake)).simulate(steps)
        hits += any("they are lost" in v for v in res.violations)
        if not mistake:
            assert res.violations == [] and res.errors == [None] * R
    assert (hits > 0) == mistake


def test_third_send_in_flight_times_out_instead_of_overwriting():
    """Three sends before the first receive: the third waits for a credit only a receive
    queued behind it could give; every rank ends in a credit timeout, nothing is
    overwritten and nothing hangs."""
    R, E, M, K, H = 4, 8, 3, 2, 2
    rng = np.random.default_rng(0)
    data = [(routing(rng, R, E, M, K, T=M),
             [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)])
            for _ in range(3)]
    steps = [[{"do": "dispatch_send", "x": data[i][1][r], "idx": data[i][0][r],
               "name": f"d{i}"} for i in range(3)]
             + [{"do": "dispatch_recv", "name": f"d{i}"} for i in range(3)]
             for r in range(R)]
    res = Sim(R, E, M, H, seed=0, timeout=1000).simulate(steps)
    assert not res.hang and res.violations == []
    for r in range(R):
        assert res.errors[r]["code"] == "timeout" and res.errors[r]["kind"] == "credit"


@pytest.mark.parametrize("P,Q", [(1, 1), (2, 1), (2, 2), (2, 4), (4, 2), (1, 3)])
def test_sender_qp_choice_and_reader_counts_agree(P, Q):
    """The kernels' sender puts row j on row_qp(reader, j); the reader waits for
    rows_on_qp(rows, reader, q) on each QP (both from low_latency_wire.h): they must agree
    for every stream length and reader, and every QP must be used once rows >= QPs."""
    from low_latency_sim import row_qp, rows_on_qp
    for reader in range(9):
        for rows in (0, 1, 2, 3, P * Q, P * Q + 1, 37):
            per_qp = np.zeros(P * Q, np.int64)
            for j in range(rows):
                q = row_qp(reader, j, P, Q)
                assert 0 <= q < P * Q
                per_qp[q] += 1
            want = [rows_on_qp(rows, reader, q, P, Q) for q in range(P * Q)]
            assert per_qp.tolist() == want, (reader, rows)
            if rows >= P * Q:
                assert per_qp.min() >= 1


def _one_combine(mutate, R=4, E=8, M=4, K=2, H=2, seed=6):
    rng = np.random.default_rng(seed)
    xs, idxs, ws = round_data(rng, R, E, M, K, H)
    d = model_dispatch(xs, idxs, E, M)
    el, rpd = E // R, M * min(K, E // R)
    steps = []
    for r in range(R):
        count = np.array([[[s for s, _ in d[r]["rows"][e]].count(s) for s in range(R)]
                          for e in range(el)], np.int32)
        first = (np.cumsum(count, 1) - count).astype(np.int32)
        steps.append([{"do": "combine_send", "y": d[r]["recv_x"], "first_row": first,
                       "row_count": count, "rows_per_dest": rpd, "name": "c"},
                      {"do": "combine_recv", "name": "c", "idx": idxs[r], "w": ws[r],
                       "rows_per_dest": rpd}])
    mutate(steps)
    return Sim(R, E, M, H, seed=seed, timeout=2000).simulate(steps)


def test_combine_owner_skipping_times_out_on_every_source():
    res = _one_combine(lambda st: st[1].clear())
    assert not res.hang
    for r in (0, 2, 3):
        assert (res.errors[r]["code"], res.errors[r]["peer"]) == ("timeout", 1), res.errors[r]


def test_combine_with_a_bad_handle_fails_every_rank():
    def bad(st):
        st[0][0]["row_count"] = st[0][0]["row_count"].copy()
        st[0][0]["row_count"][0, 0] = 99  # more rows than M
    res = _one_combine(bad)
    assert res.errors[0]["code"] == "bad_handle"
    for r in (1, 2, 3):
        assert res.errors[r] == {"code": "peer_failed", "peer": 0, "rank": r}
    assert res.violations == []


@pytest.mark.parametrize("first_epoch", [2**31 - 3, 2**32 - 3])
@pytest.mark.parametrize("mistake", [False, True])
def test_epochs_past_the_int32_token(first_epoch, mistake):
    """The token is int32: past 2^31 calls of an op (days of decoding) its epoch word is
    negative, past 2^32 it wraps. The receive half widens it against its PE's counter
    (widen_epoch, through the bindings); taking the int32 as the epoch waits for a header
    no one sends."""
    R, E, M, K, H = 4, 8, 3, 2, 2
    res, want_d, want_c, _ = run_rounds(R, E, M, K, H, rounds=3, seed=1, depth2=True,
                                        first_epoch=first_epoch, timeout=1500,
                                        mistakes=Mistakes(narrow_token=mistake))
    assert not res.hang and res.violations == []
    if mistake:
        assert all(e is not None and e["code"] == "timeout" for e in res.errors), res.errors
    else:
        assert res.errors == [None] * R
        check_exact(res, want_d, want_c, R)


def test_widen_epoch_recovers_the_epoch_from_its_low_bits():
    from low_latency_sim import token_word, widen_epoch
    for n in (1, 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**32 + 7):
        for ahead in (0, 1):  # the counter is at n, or one call further (two in flight)
            assert widen_epoch(n + ahead, token_word(n)) == n, (n, ahead)


@pytest.mark.parametrize("mistake", [False, True])
def test_planted_missing_quiet_reuses_the_send_stage(mistake):
    """The puts read the stages when they land. A send that returns before its puts
    complete lets the next call's plan and pack rewrite the rows and headers still in
    flight (two sends back to back, as in the FP8 dispatch)."""
    hits = 0
    for seed in range(4):
        res, want_d, want_c, _ = run_rounds(4, 8, 4, 2, 2, rounds=4, seed=seed, depth2=True,
                                            policy="lazy",
                                            mistakes=Mistakes(no_quiet=mistake))
        hits += any("send buffer reused before quiet" in v for v in res.violations)
        if not mistake:
            assert res.violations == [] and res.errors == [None] * 4
            check_exact(res, want_d, want_c, 4)
    assert (hits > 0) == mistake


def _swap_one_expert_within_its_owner(idx, el):
    """A copy of idx[S, K] where one slot names the other local expert of the same owner
    (not already in that token): every owner's total is kept, one expert's count moves."""
    idx = idx.copy()
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            g = int(idx[t, k])
            if g < 0:
                continue
            for g2 in range((g // el) * el, (g // el + 1) * el):
                if g2 != g and g2 not in idx[t]:
                    idx[t, k] = g2
                    return idx
    raise AssertionError("no slot to move")


@pytest.mark.parametrize("mistake", [False, True])
def test_combine_with_other_per_expert_counts_is_an_error(mistake):
    """A source whose combine routing keeps each owner's total but moves a row between two
    experts of one owner: checking totals only reads rows at the wrong offsets without an
    error; the per-expert check in the header fails the call on that source."""
    R, E, M, K, H = 4, 8, 4, 2, 2
    el = E // R
    rng = np.random.default_rng(7)
    xs, idxs, ws = round_data(rng, R, E, M, K, H)
    idxs[2] = routing(np.random.default_rng(8), 1, E, M, K, T=M)[0]
    d = model_dispatch(xs, idxs, E, M)
    other = _swap_one_expert_within_its_owner(idxs[2], el)
    steps = []
    for r in range(R):
        count = np.array([[[s for s, _ in d[r]["rows"][e]].count(s) for s in range(R)]
                          for e in range(el)], np.int32)
        first = (np.cumsum(count, 1) - count).astype(np.int32)
        steps.append([{"do": "combine_send", "y": d[r]["recv_x"], "first_row": first,
                       "row_count": count, "rows_per_dest": M * min(K, el), "name": "c"},
                      {"do": "combine_recv", "name": "c", "idx": other if r == 2 else idxs[r],
                       "w": ws[r], "rows_per_dest": M * min(K, el)}])
    res = Sim(R, E, M, H, seed=1, mistakes=Mistakes(total_rows_only=mistake)).simulate(steps)
    assert res.violations == [] and [res.errors[r] for r in (0, 1, 3)] == [None] * 3
    if mistake:
        # not caught: rank 2 returns a sum of the wrong rows, silently
        assert res.errors[2] is None
        want = model_combine([d[r]["recv_x"] for r in range(R)],
                             [other if r == 2 else idxs[r] for r in range(R)], ws, d, E)[2]
        assert not np.array_equal(res.outputs[2][1], want)
    else:
        err = res.errors[2]
        assert err["code"] == "rows_mismatch" and err["expected"] != err["seen"], err


def model_combine_by_handle(ys, handles, idxs, ws, E, M):
    """out_s[t] = sum over k of w * y_o[e, first_row_o[e, s] + p], p the slot's place
    among s's tokens naming that expert: what the CPU kernel computes for any in-bounds
    handle (it copies each source's range of each block as the handle gives it)."""
    R = len(ys)
    el = E // R
    outs = []
    for s in range(R):
        S, K = idxs[s].shape
        seen = np.zeros(E, np.int64)
        out = np.zeros((S, ys[0].shape[-1]), np.float32)
        for t in range(S):
            acc = np.zeros(ys[0].shape[-1], np.float32)
            for k in range(K):
                g = int(idxs[s][t, k])
                if g < 0:
                    continue
                p, seen[g] = seen[g], seen[g] + 1
                if p >= M:
                    continue
                o, e = g // el, g % el
                v = ys[o][e, handles[o][0][e, s] + p]
                acc = (acc + (np.float32(ws[s][t, k]) * v).astype(np.float32)).astype(np.float32)
            out[t] = acc
        outs.append(out)
    return outs


@pytest.mark.parametrize("mistake", [False, True])
def test_combine_handle_with_overlapping_ranges(mistake):
    """A handle whose first_row does not lay the sources back to back (here source 1's
    range of every expert of owner 0 starts where source 0's does): the owner stages each
    source's range as the handle gives it, as the CPU kernel does. Packing y row by row
    into the first source whose range holds it leaves source 1's stage rows unwritten."""
    R, E, M, K, H = 4, 8, 4, 2, 2
    rng = np.random.default_rng(6)
    xs, idxs, ws = round_data(rng, R, E, M, K, H)
    idxs = routing(np.random.default_rng(9), R, E, M, K, T=M)
    for s in (0, 1):  # owner 0's expert 0 gets a row from sources 0 and 1
        idxs[s][0] = [0] + [-1] * (K - 1)
    d = model_dispatch(xs, idxs, E, M)
    el, rpd = E // R, M * min(K, E // R)
    ys = [(2 * d[r]["recv_x"] + r + 1).astype(np.float32) for r in range(R)]
    handles, steps = [], []
    for r in range(R):
        count = np.array([[[s for s, _ in d[r]["rows"][e]].count(s) for s in range(R)]
                          for e in range(el)], np.int32)
        first = (np.cumsum(count, 1) - count).astype(np.int32)
        if r == 0:
            first[:, 1] = first[:, 0]
        handles.append((first, count))
        steps.append([{"do": "combine_send", "y": ys[r], "first_row": first,
                       "row_count": count, "rows_per_dest": rpd, "name": "c"},
                      {"do": "combine_recv", "name": "c", "idx": idxs[r], "w": ws[r],
                       "rows_per_dest": rpd}])
    res = Sim(R, E, M, H, seed=2, mistakes=Mistakes(pack_first_match=mistake)).simulate(steps)
    if mistake:
        assert any("unwritten stage row" in v for v in res.violations), res.violations
        return
    assert res.violations == [] and res.errors == [None] * R
    want = model_combine_by_handle(ys, handles, idxs, ws, E, M)
    for r in range(R):
        np.testing.assert_array_equal(res.outputs[r][1].view(np.uint32), want[r].view(np.uint32))


@pytest.mark.parametrize("seed", [0, 1])
def test_two_sends_in_flight_received_in_reverse_order(seed):
    """Two dispatch sends, then their receives in reverse order: each receive completes
    the epoch of its own token (widened against the counter, one call ahead or level)."""
    R, E, M, K, H = 4, 8, 3, 2, 2
    rng = np.random.default_rng(seed)
    data = [(routing(rng, R, E, M, K, T=M),
             [rng.standard_normal((M, H)).astype(np.float32) for _ in range(R)])
            for _ in range(4)]
    want = [model_dispatch(xs, idxs, E, M) for idxs, xs in data]
    steps = []
    for r in range(R):
        st = []
        for a, b in ((0, 1), (2, 3)):
            st += [{"do": "dispatch_send", "x": data[i][1][r], "idx": data[i][0][r],
                    "name": f"d{i}"} for i in (a, b)]
            st += [{"do": "dispatch_recv", "name": f"d{i}"} for i in (b, a)]
        steps.append(st)
    res = Sim(R, E, M, H, seed=seed, first_epoch=2**32 - 2).simulate(steps)
    assert res.violations == [] and res.errors == [None] * R and not res.hang
    for r in range(R):
        got = [o for o in res.outputs[r] if o is not None]
        for o, i in zip(got, (1, 0, 3, 2)):
            np.testing.assert_array_equal(o[0].view(np.uint32),
                                          want[i][r]["recv_x"].view(np.uint32))
            np.testing.assert_array_equal(o[3], want[i][r]["src_index"])


def test_combine_routing_with_a_repeated_id_is_an_error_there():
    """combine_recv's plan (as CombineRecvPlan) gives a repeated id a position per slot:
    that expert's count exceeds what its owner returns, so the source fails the call
    instead of reading a row twice; the others are exact."""
    R, E, M, K, H = 4, 8, 4, 2, 2
    rng = np.random.default_rng(3)
    xs, _, ws = round_data(rng, R, E, M, K, H)
    idxs = routing(np.random.default_rng(4), R, E, M, K, T=M)
    d = model_dispatch(xs, idxs, E, M)
    el, rpd = E // R, M * min(K, E // R)
    rep = idxs[1].copy()
    t = int(np.flatnonzero(rep[:, 0] >= 0)[0])
    rep[t, 1] = rep[t, 0]
    steps = []
    for r in range(R):
        count = np.array([[[s for s, _ in d[r]["rows"][e]].count(s) for s in range(R)]
                          for e in range(el)], np.int32)
        first = (np.cumsum(count, 1) - count).astype(np.int32)
        steps.append([{"do": "combine_send", "y": d[r]["recv_x"], "first_row": first,
                       "row_count": count, "rows_per_dest": rpd, "name": "c"},
                      {"do": "combine_recv", "name": "c", "idx": rep if r == 1 else idxs[r],
                       "w": ws[r], "rows_per_dest": rpd}])
    res = Sim(R, E, M, H, seed=0).simulate(steps)
    assert res.violations == []
    assert res.errors[1]["code"] == "rows_mismatch", res.errors[1]
    want = model_combine([d[r]["recv_x"] for r in range(R)], idxs, ws, d, E)
    for r in (0, 2, 3):
        assert res.errors[r] is None
        np.testing.assert_array_equal(res.outputs[r][1], want[r])
