"""The host simulator of the internode protocol (tests/sim/internode_sim.py, a model on
the CPU, not a GPU run), kept for what the emulated GPU cannot reach: 32 ranks over many
calls, a repeated call site skipped, a rank late past the timeout, and the wire rules it
checks. The kernels themselves run in tests/emu/test_internode_emu.py."""
import dataclasses

import numpy as np
import pytest

import internode_sim as S


def _inputs(R, T, H, K, E, seed, bad_rank=None, tokens=None):
    rng = np.random.default_rng(seed)
    Ts = tokens or [T] * R
    xs, idxs, ws = [], [], []
    for r in range(R):
        t = Ts[r]
        xs.append(rng.standard_normal((t, H)).astype(np.float32))
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).astype(np.int32) \
            if t else np.zeros((0, K), np.int32)
        if t:
            idx[rng.random((t, K)) < 0.15] = -1
        if r == bad_rank and t:
            idx[t // 2, 0] = E + 3
        idxs.append(idx)
        ws.append(rng.random((t, K)).astype(np.float32))
    return xs, idxs, ws


def _dispatch_calls(xs, idxs, ws, C, E):
    return [S.Call("dispatch", x=x, topk_idx=i, topk_w=w, capacity=C, num_experts=E)
            for x, i, w in zip(xs, idxs, ws)]


def _run(per_rank, **kw):
    w = S.simulate(per_rank, **kw)
    return w


def _handles(w, call=0):
    return [{"counts": rk.results[call]["counts"], "send_slot": rk.results[call]["send_slot"]}
            for rk in w.ranks]


# --- constants come from the compiled header ---------------------------------------------

def test_constants_are_the_compiled_ones():
    assert S.MAX_QPS == 64 and S.HEADER_BYTES == 64 and S.CONTROL_QP == 0
    R = 5
    words = {S.sig_word(k, R, s, q) for k in S.PROTO["sig_kinds"] for s in range(R)
             for q in range(S.MAX_QPS)}
    assert words == set(range(S.PROTO["num_sig_kinds"] * R * S.MAX_QPS))
    for (R, T, C, H, K) in [(2, 4, 8, 7, 2), (32, 16, 100, 33, 8)]:
        L = S.layout(R, T, C, H, K, 2, 4)
        assert L["dispatch_meta_offset"] % 16 == 0  # odd H in 16-bit dtypes stays aligned


def test_expected_signal_counts_the_chunks_on_each_qp():
    for P, Q in [(1, 1), (2, 1), (2, 3), (4, 2)]:
        NQ = P * Q
        for peer in range(9):
            chans = [S.channel_of_qp(peer, q, P, Q) for q in range(NQ)]
            assert sorted(chans) == list(range(NQ))  # one channel per QP
            for n in (0, 1, NQ - 1, NQ, 3 * NQ + 1):
                per_qp = [0] * NQ
                for j in range(n):
                    per_qp[S.qp_for(peer, j % NQ, j, P, Q)[0]] += 1
                assert [S.expected_signal(n, peer, q, P, Q) - 1 for q in range(NQ)] == per_qp


# --- what the emulated GPU cannot reach: 32 ranks -------------------------------------------
# (results at 2 to 8 ranks, the transport log per port, skips, mismatches, bad ids and T = 0
# are checked on the kernels themselves: tests/emu/test_internode_emu.py)

def test_32_ranks_many_calls_no_half_reused_early():
    R, T, H, K, C = 32, 2, 2, 2, 8
    E = R
    xs, idxs, ws = _inputs(R, T, H, K, E, 11)
    y = np.ones((R, C, H), np.float32)
    w0 = _run([[c] for c in _dispatch_calls(xs, idxs, ws, C, E)], seed=5)
    hs = _handles(w0)
    calls = []
    for r in range(R):
        d = S.Call("dispatch", x=xs[r], topk_idx=idxs[r], topk_w=ws[r], capacity=C,
                   num_experts=E)
        cmb = S.Call("combine", x=y[r], handle=hs[r], capacity=C, topk=K)
        calls.append([d, cmb, d])
    w = _run(calls, num_ports=2, qps_per_port=2, chunk_bytes=16, seed=9, policy="random")
    assert w.violations == [] and all(rk.error is None for rk in w.ranks)
    assert all(rk.done == 3 for rk in w.ranks)


# --- fault cases --------------------------------------------------------------------------

def _two_calls(R=4, T=4, H=3, K=2, C=16, seed=0, **kw):
    """Two dispatches from two call sites (as two ops in one traced program)."""
    E = 2 * R
    xs, idxs, ws = _inputs(R, T, H, K, E, seed, **kw)
    return [[c, dataclasses.replace(c, call_site=2)]
            for c in _dispatch_calls(xs, idxs, ws, C, E)]


def test_a_rank_that_skips_a_repeated_call_times_out_everywhere():
    """The same call site twice (a loop body): rank 2's second call pairs with the
    others' first (identical, so indistinguishable); the others then time out on rank 2
    and go silent, so rank 2 times out at its next call. Nobody goes on for long."""
    calls = _two_calls()
    calls = [[cs[0], cs[0], cs[1]] for cs in calls]
    calls[2] = [None, calls[2][1], calls[2][2]]
    w = _run(calls, timeout=3000)
    for r in (0, 1, 3):
        e = w.ranks[r].error
        assert e["code"] in ("timeout", "mismatch") and e["peer"] == 2
        assert w.ranks[r].results[1:] == [None, None]
    assert w.ranks[2].error["code"] in ("timeout", "mismatch")
    assert w.ranks[2].results[-1] is None


def test_late_past_the_timeout_fails_everyone_within_it_succeeds():
    calls = _two_calls()
    late = [[c for c in cs] for cs in calls]
    late[1][0] = dataclasses.replace(late[1][0], delay=5000)
    w = _run(late, timeout=1000)
    assert all(rk.error is not None for rk in w.ranks)
    assert w.ranks[0].error["peer"] == 1 and w.ranks[0].error["code"] == "timeout"
    ok = [[c for c in cs] for cs in calls]
    ok[1][0] = dataclasses.replace(ok[1][0], delay=200)
    w = _run(ok, timeout=5000)
    assert w.violations == [] and all(rk.error is None for rk in w.ranks)


# --- planted mistakes: each must be reported --------------------------------------------------

def _clean(**kw):
    return _run(_two_calls(seed=5), num_ports=2, qps_per_port=2, chunk_bytes=16, **kw)


def test_baseline_has_no_findings():
    for policy in ("random", "lazy"):
        w = _clean(policy=policy, seed=1)
        assert w.violations == [] and all(rk.error is None for rk in w.ranks)


def test_planted_shared_counter_across_qps_is_caught():
    w = _clean(mistakes=S.Mistakes(shared_counter=True), timeout=2000)
    assert any("more than one QP" in v for v in w.violations)


def test_planted_early_wait_is_caught():
    w = _clean(mistakes=S.Mistakes(early_wait=True), policy="lazy")
    assert any("before it landed" in v for v in w.violations)


def test_planted_zero_token_combine_without_wait_is_caught():
    R, H, K, C, E = 4, 3, 2, 16, 8
    xs, idxs, ws = _inputs(R, 0, H, K, E, 2, tokens=[0] * R)
    disp = _dispatch_calls(xs, idxs, ws, C, E)
    hs = _handles(_run([[c] for c in disp]))
    y = np.ones((R, C, H), np.float32)
    calls = [[S.Call("combine", x=y[r], handle=hs[r], capacity=C, topk=K)] * 4
             for r in range(R)]
    w = _run(calls, mistakes=S.Mistakes(t0_skips_wait=True), policy="lazy")
    assert any("did not wait" in v for v in w.violations)
    w = _run(calls, policy="lazy")
    assert w.violations == [] and all(rk.error is None for rk in w.ranks)


def test_core_is_reusable_for_another_schedule():
    """The Wire core alone: a two-rank ping over one QP, with its own word count."""
    w = S.Wire(2, 1, 1, 64, nwords=4, policy="lazy")

    def sender():
        w.write_local(0, 0, 0, b"abcd", 0)
        yield ("put", S.Put(0, 1, 0, 0, 0, 16, b"abcd", 3, "add", 1))

    def receiver():
        ok = yield ("wait", 0, 3, 1, 0, "ping", 0)
        assert ok
        assert w.read(1, 0, 16, 4, 0, "ping") == b"abcd"
        w.ranks[1].done += 1

    w.run([sender(), receiver()])
    assert w.violations == [] and w.port_bytes[0, 0] == 4 and w.ranks[1].done == 1
    with pytest.raises(ValueError, match="policy"):
        S.Wire(2, 1, 1, 64, policy="fifo")
