"""The intranode low-latency CUDA kernels (kernels/cuda/low_latency_kernels.cu) run on the
emulated GPU through the CUDA backend's real-rank handlers: the send and receive halves
as separate calls, bit for bit against the reference backend."""
from __future__ import annotations

import numpy as np
import pytest

import jax_ep

from jax_ep._src.emu import Emulator

from emu_fp8_util import fp8_reference, fp8_rows
from emu_intranode_util import (LL_DISPATCH_KEYS, LL_WIDE_ROW_KINDS, LL_WIDE_ROWS, assert_same,
                                bits, check_wide_row_routing, ll_reference, ll_routing, rows)

pytestmark = pytest.mark.emu


def _setup(R, S, H, K, E, M, dtype, seed, **kw):
    emu = Emulator(R, seed=seed, **kw)
    rb = rows(dtype, (1, 1, H), np.random.default_rng(0)).nbytes
    emu.setup(tokens=S, capacity=S, row_bytes=rb, topk=K, ll_shape=(M, K, E, rb))
    return emu


def _inputs(R, S, H, K, E, M, dtype, seed):
    rng = np.random.default_rng(seed)
    idx = ll_routing(R, S, K, E, rng)
    x = rows(dtype, (R, S, H), rng)
    w = rng.standard_normal((R, S, K)).astype(np.float32)
    y = rows(dtype, (R, E // R, R * M, H), rng)
    return x, idx, w, y


def assert_ll_same(got, want, keys, what=""):
    """assert_same, recv_x compared only in rows below recv_count (rows past it are
    unspecified on GPU: the receive kernel does not write them)."""
    rest = [k for k in keys if k != "recv_x"]
    assert_same(got, want, rest, what)
    if "recv_x" not in keys:
        return
    g, w = np.asarray(got["recv_x"]), np.asarray(want["recv_x"])
    assert g.shape == w.shape, f"{what}recv_x: shape {g.shape} != {w.shape}"
    count = np.asarray(want["recv_count"])
    for r in range(g.shape[0]):
        for e in range(g.shape[1]):
            c = int(count[r, e])
            if not np.array_equal(bits(g[r, e, :c]), bits(w[r, e, :c])):
                bad = np.argwhere(bits(g[r, e, :c]) != bits(w[r, e, :c]))[:5].tolist()
                raise AssertionError(f"{what}recv_x rank {r} expert {e} differs at {bad}")


def _round(emu, x, idx, w, y, *, E, M, K):
    """One dispatch and one combine, each as its send halves then its receive halves."""
    H = x.shape[2]
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    rpd = M * min(K, E // emu.R)
    c = emu.ll_combine_send(y, d["first_row"], d["row_count"], max_tokens=M, rows_per_dest=rpd)
    d["out"] = emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M)
    return d, rpd


QUICK = [(2, 6, 16, 2, 4, 6, "bf16", 1)]
FULL = [
    (2, 1, 8, 1, 2, 1, "f32", 2),     # one token
    (4, 4, 3, 2, 8, 4, "bf16", 3),    # rows of 6 bytes
    (4, 4, 24, 3, 8, 4, "f16", 4),
]


@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", QUICK)
def test_ll_dispatch_combine(R, S, H, K, E, M, dtype, seed):
    emu = _setup(R, S, H, K, E, M, dtype, seed)
    x, idx, w, y = _inputs(R, S, H, K, E, M, dtype, seed)
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"seed {seed}: ")
    assert emu.check_errors() == []


@pytest.mark.emu_full
@pytest.mark.parametrize("R,S,H,K,E,M,dtype,seed", FULL)
def test_ll_dispatch_combine_full(R, S, H, K, E, M, dtype, seed):
    test_ll_dispatch_combine(R, S, H, K, E, M, dtype, seed)


@pytest.mark.parametrize("H,dtype,seed", [k + (s,) for k, s in zip(LL_WIDE_ROW_KINDS, (7, 8))])
def test_ll_combine_top_k_past_one_batch_over_wide_rows(H, dtype, seed):
    """The combine's receive sum over the wide-row case (emu_intranode_util.LL_WIDE_ROWS),
    bit-exact in float32 outputs: a row left out of a batch, a batch or an item's units
    misplaced, or the adds in another k order show."""
    R, S, K, E, M = (LL_WIDE_ROWS[k] for k in "RSKEM")
    emu = _setup(R, S, H, K, E, M, dtype, seed)
    x, idx, w, y = _inputs(R, S, H, K, E, M, dtype, seed)
    check_wide_row_routing(idx)
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"H={H}: ")
    assert emu.check_errors() == []


def test_ll_combine_items_fill_the_grid():
    """The receive sum deals (token, chunk) items over the grid's warps, not a warp per
    token: 4 tokens of 2048 bf16 (256 vectors, 4 items each) are 16 items, 2 blocks of 8
    warps on each rank, where a warp per token fits in one."""
    R, S, H, K, E, M = 2, 4, 2048, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 9)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 9)
    emu.reset_counters()
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",))
    assert emu.counters()["kernel:ll_combine_recv:blocks"] == 2 * R


@pytest.mark.emu_full
def test_ll_consecutive_calls_reuse_halves():
    """Seven rounds on one group: each half (epoch parity) of slots, counts and stages is
    reused three times, its credits returned in between; new data every round."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 5, resident_blocks=2)
    for call in range(7):
        x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 30 + call)
        got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
        want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"call {call}: ")
    assert emu.check_errors() == []


def test_ll_two_sends_in_flight():
    """Two dispatch send halves before either receive half: they use the two halves of
    the buffer, and each receive half reads its own call's rows."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 6)
    a = _inputs(R, S, H, K, E, M, "bf16", 40)
    b = _inputs(R, S, H, K, E, M, "bf16", 41)
    sa = emu.ll_dispatch_send(a[0], a[1], num_experts=E, max_tokens=M)
    sb = emu.ll_dispatch_send(b[0], b[1], num_experts=E, max_tokens=M)
    da = emu.ll_dispatch_recv(sa, num_experts=E, max_tokens=M, H=H, dtype=a[0].dtype)
    db = emu.ll_dispatch_recv(sb, num_experts=E, max_tokens=M, H=H, dtype=b[0].dtype)
    rpd = M * min(K, E // R)
    for got, inp in ((da, a), (db, b)):
        want = ll_reference(*inp, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS)
    assert emu.check_errors() == []


def test_ll_rank_that_skips_a_call_ends_in_errors_on_every_rank():
    """Rank 1 skips a dispatch (both halves): rank 0's receive half times out (its own
    timeout, in virtual time) and returns no rows. Rank 1 is then a call behind: its next
    receive half matches rank 0's earlier send (same call, same tag, the other half of the
    buffer), the one after meets rank 0's failed state, and by then every rank reports."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 7, timeout_s=0.002)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 7)
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M, skip=[1])
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype, skip=[1])
    errs = emu.check_errors()
    assert any("rank 0]" in e for e in errs) and not any("rank 1]" in e for e in errs), errs
    assert (d["recv_count"][0] == 0).all() and (d["src_rank"][0] == -1).all()
    for _ in range(2):
        s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
        emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
        errs += emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == {0, 1}, errs


# ---- cases ported from the former host simulator (foreign handle, order, faults) ----

@pytest.mark.emu_full
@pytest.mark.parametrize("resident_blocks", [2, None])
def test_ll_resident_blocks_small_and_default(resident_blocks):
    """No block of a low-latency kernel waits for another block of the same kernel, so
    two resident blocks per virtual GPU finish as the default does, bit-exact."""
    R, S, H, K, E, M = 2, 5, 64, 3, 8, 5
    emu = _setup(R, S, H, K, E, M, "bf16", 21, resident_blocks=resident_blocks)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 21)
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"resident {resident_blocks}: ")
    assert emu.check_errors() == []


@pytest.mark.emu_full
def test_ll_no_tokens_all_ids_unused():
    """T = 0 (jax_ep.low_latency pads to M rows of -1) and all ids -1: no rows anywhere,
    every count 0, combine zeros; the next round with real routing is exact."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "f32", 22)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "f32", 22)
    none = np.full_like(idx, -1)
    got, rpd = _round(emu, x, none, w, y, E=E, M=M, K=K)
    want = ll_reference(x, none, w, y, E=E, M=M, rows_per_dest=rpd)
    assert (want["recv_count"] == 0).all()
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), "all -1: ")
    got, rpd = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), "after: ")
    assert emu.check_errors() == []


@pytest.mark.parametrize("R,S,H,K,E,M,dtype,round_scale", [
    (2, 4, 256, 2, 4, 4, "bf16", False),
    pytest.param(4, 5, 384, 3, 8, 6, "f32", True, marks=pytest.mark.emu_full),
    pytest.param(2, 1, 128, 2, 4, 1, "f16", False, marks=pytest.mark.emu_full),
    pytest.param(2, 6, 128, 1, 2, 6, "bf16", True, marks=pytest.mark.emu_full),
])
def test_ll_fp8_one_message(R, S, H, K, E, M, dtype, round_scale):
    """fp8: the send kernel casts each row (values and 1 x 128 scales in one message per
    (token, expert)); the receive half's recv_x / recv_scales equal the reference
    backend's jax_ep.fp8.quantize pair bit for bit, with the same handle."""
    rng = np.random.default_rng(31 + H + S)
    idx = ll_routing(R, S, K, E, rng)
    x = fp8_rows(R, S, H, dtype, rng)
    emu = Emulator(R, seed=31)
    W = (H + 4 * (H // 128) + 15) // 16 * 16
    emu.setup(tokens=S, capacity=S, row_bytes=W, topk=K, ll_shape=(M, K, E, W))
    want = fp8_reference(x, idx, E=E, M=M, round_scale=round_scale)
    for _ in range(3):  # both halves of the area, and one reused
        s = emu.ll_dispatch_send_fp8(x, idx, num_experts=E, max_tokens=M,
                                     round_scale=round_scale)
        got = emu.ll_dispatch_recv_fp8(s, num_experts=E, max_tokens=M, H=H)
        assert_same(got, want, LL_DISPATCH_KEYS[1:])
        for r in range(R):
            for e in range(E // R):
                c = int(want["recv_count"][r, e])
                for key in ("recv_x", "recv_scales"):
                    np.testing.assert_array_equal(bits(got[key][r, e, :c]),
                                                  bits(want[key][r, e, :c]), err_msg=key)
    assert emu.check_errors() == []


def test_ll_fp8_no_tokens_and_one_token():
    """All ids -1 (no messages, zero counts), then one token per rank (T = 1 padded to
    M rows of -1 ids), H = 128: exact against the reference."""
    R, S, H, K, E, M = 2, 3, 128, 2, 4, 3
    rng = np.random.default_rng(33)
    emu = Emulator(R, seed=33)
    emu.setup(tokens=S, capacity=S, row_bytes=144, topk=K, ll_shape=(M, K, E, 144))
    x = fp8_rows(R, S, H, "bf16", rng)
    none = np.full((R, S, K), -1, np.int32)
    one = none.copy()
    one[:, 0] = ll_routing(R, 1, K, E, rng, p_unused=0.0)[:, 0]
    for idx in (none, one):
        want = fp8_reference(x, idx, E=E, M=M, round_scale=False)
        s = emu.ll_dispatch_send_fp8(x, idx, num_experts=E, max_tokens=M)
        got = emu.ll_dispatch_recv_fp8(s, num_experts=E, max_tokens=M, H=H)
        assert_same(got, want, LL_DISPATCH_KEYS[1:])
        for r in range(R):
            for e in range(E // R):
                c = int(want["recv_count"][r, e])
                for key in ("recv_x", "recv_scales"):
                    np.testing.assert_array_equal(bits(got[key][r, e, :c]),
                                                  bits(want[key][r, e, :c]), err_msg=key)
    assert (fp8_reference(x, none, E=E, M=M, round_scale=False)["recv_count"] == 0).all()
    assert emu.check_errors() == []


def test_ll_fp8_one_message_per_token_and_expert():
    """Counted by the emulated GPU (not measured): the FP8 dispatch releases one arrival
    word per (expert, source) and stores one token id per (token, expert), half of what
    values and scales sent as two dispatches of one routing do, in one send and one
    receive launch per rank instead of two; its peer bytes are fewer too."""
    R, S, H, K, E, M = 2, 6, 256, 2, 4, 6
    rng = np.random.default_rng(34)
    idx = ll_routing(R, S, K, E, rng, p_unused=0.0)
    x = fp8_rows(R, S, H, "bf16", rng)
    emu = Emulator(R, seed=34)
    emu.setup(tokens=S, capacity=S, row_bytes=2 * H, topk=K, ll_shape=(M, K, E, 2 * H))

    def peer_bytes(c):
        return sum(v * int(k.rsplit(":", 1)[1]) for k, v in c.items()
                   if k.startswith("stores:peer:") and k.rsplit(":", 1)[1].isdigit())

    emu.reset_counters()
    s = emu.ll_dispatch_send_fp8(x, idx, num_experts=E, max_tokens=M)
    emu.ll_dispatch_recv_fp8(s, num_experts=E, max_tokens=M, H=H)
    one = emu.counters()
    # The same pair as two dispatches of one routing (what jax_ep sent before).
    import jax.numpy as jnp

    from jax_ep import fp8
    q, sc = (np.asarray(a) for a in fp8.quantize(jnp.asarray(x.astype(np.float32))))
    emu.reset_counters()
    for a in (q, sc):
        s2 = emu.ll_dispatch_send(a, idx, num_experts=E, max_tokens=M)
        emu.ll_dispatch_recv(s2, num_experts=E, max_tokens=M, H=a.shape[2], dtype=a.dtype)
    two = emu.counters()
    # Per dispatch: a word per (expert, source), a credit per (owner, source).
    assert one["release_stores"] * 2 == two["release_stores"] == 2 * (R * E + R * R), (one, two)
    assert one["kernel:ll_dispatch_send:launches"] == R
    assert two["kernel:ll_dispatch_send:launches"] == 2 * R
    assert one["kernel:ll_dispatch_recv:launches"] == R
    # Stores into the slots (peer, or local for a rank's own experts): one 16-byte store
    # per 16 values, one per scale and one token id per row, fewer than the two calls'.
    rows = int(sum(np.count_nonzero(idx[r] >= 0) for r in range(R)))
    slot_stores = lambda c: sum(c.get(f"stores:{sp}:{w}", 0)  # noqa: E731
                                for sp in ("peer",) for w in (1, 4, 8, 16))
    assert one.get("stores:peer:1", 0) == 0  # the scales too go in whole words
    assert slot_stores(one) < slot_stores(two), (slot_stores(one), slot_stores(two))
    assert 0 < peer_bytes(one) < peer_bytes(two), (peer_bytes(one), peer_bytes(two))
    assert rows > 0
    assert emu.check_errors() == []


@pytest.mark.emu_full
def test_ll_receive_halves_out_of_order():
    """Two sends of each op in flight, their receive halves in reverse order: each
    receive half takes its own epoch (handed over by its send half) and its own half."""
    R, S, H, K, E, M = 2, 4, 16, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 24)
    a = _inputs(R, S, H, K, E, M, "bf16", 50)
    b = _inputs(R, S, H, K, E, M, "bf16", 51)
    rpd = M * min(K, E // R)
    sa = emu.ll_dispatch_send(a[0], a[1], num_experts=E, max_tokens=M)
    sb = emu.ll_dispatch_send(b[0], b[1], num_experts=E, max_tokens=M)
    db = emu.ll_dispatch_recv(sb, num_experts=E, max_tokens=M, H=H, dtype=b[0].dtype)
    da = emu.ll_dispatch_recv(sa, num_experts=E, max_tokens=M, H=H, dtype=a[0].dtype)
    ca = emu.ll_combine_send(a[3], da["first_row"], da["row_count"], max_tokens=M,
                             rows_per_dest=rpd)
    cb = emu.ll_combine_send(b[3], db["first_row"], db["row_count"], max_tokens=M,
                             rows_per_dest=rpd)
    db["out"] = emu.ll_combine_recv(cb, b[1], b[2], num_experts=E, max_tokens=M)
    da["out"] = emu.ll_combine_recv(ca, a[1], a[2], num_experts=E, max_tokens=M)
    for got, inp, name in ((da, a, "first"), (db, b, "second")):
        want = ll_reference(*inp, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",), f"{name}: ")
    # three more rounds reuse both halves after the reversed pair
    for call in range(3):
        x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 60 + call)
        got, _ = _round(emu, x, idx, w, y, E=E, M=M, K=K)
        assert_ll_same(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd),
                       LL_DISPATCH_KEYS + ("out",), f"round {call}: ")
    assert emu.check_errors() == []


def test_ll_third_send_waits_for_credit():
    """Two data halves: a third dispatch send before the first receive half waits for a
    credit only that receive half gives, and times out with an error on every rank
    instead of overwriting the first call's unread rows."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 25, timeout_s=0.002)
    x, idx, _, _ = _inputs(R, S, H, K, E, M, "bf16", 25)
    for _ in range(3):
        emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    errs = emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == set(range(R)), errs
    assert all("waiting for an owner's credit" in e for e in errs), errs


def test_ll_foreign_handle_counts_as_zero_everywhere_and_is_not_sticky():
    """Rank 1's combine gets a handle whose row count passes its y: rank 1 sends no rows
    and tells every source, whose sums count rank 1's experts as zero; every rank
    reports it, and the next round is exact again."""
    R, S, H, K, E, M = 2, 4, 16, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "f32", 26)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "f32", 26)
    rpd = M * min(K, E // R)
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    rc = d["row_count"].copy()
    rc[1, 0, 0] = R * M + 1
    c = emu.ll_combine_send(y, d["first_row"], rc, max_tokens=M, rows_per_dest=rpd)
    out = emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M)
    y0 = y.copy()
    y0[1] = 0
    want = ll_reference(x, idx, w, y0, E=E, M=M, rows_per_dest=rpd)
    np.testing.assert_array_equal(bits(out), bits(want["out"]))
    errs = emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == set(range(R)), errs
    assert all("does not belong to this call" in e for e in errs), errs
    got, _ = _round(emu, x, idx, w, y, E=E, M=M, K=K)
    assert_ll_same(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd),
                   LL_DISPATCH_KEYS + ("out",), "next round: ")
    assert emu.check_errors() == []


@pytest.mark.emu_full
def test_ll_bad_and_repeated_ids_are_reported_and_left_out():
    """An id outside [-1, E) and an id repeated within a token: reported on that rank,
    left unused by dispatch and combine; the other rows are exact."""
    R, S, H, K, E, M = 2, 4, 16, 3, 4, 4
    emu = _setup(R, S, H, K, E, M, "f32", 27)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "f32", 27)
    clean = idx.copy()
    clean[0, 1] = [1, 2, -1]
    clean[1, 2] = [0, 3, -1]
    bad = clean.copy()
    bad[0, 1, 2] = 1        # repeat of slot 0
    bad[1, 2, 2] = E + 3    # outside
    rpd = M * min(K, E // R)
    got, _ = _round(emu, x, bad, w, y, E=E, M=M, K=K)
    want = ll_reference(x, clean, w, y, E=E, M=M, rows_per_dest=rpd)
    assert_ll_same(got, want, LL_DISPATCH_KEYS + ("out",))
    errs = emu.check_errors()
    assert any("rank 0]" in e and "duplicate ids" in e for e in errs), errs
    assert any("rank 1]" in e and "is outside [-1, 4)" in e for e in errs), errs


def test_ll_one_arrival_word_per_expert_and_source_and_grids_in_the_budget(monkeypatch):
    """Counted by the emulated GPU (not measured): each send half releases one arrival
    word per (expert, source) pair (R * E per op, the data itself unsignalled), and no
    low-latency kernel launches more blocks than JAX_EP_NUM_SMS allows."""
    R, S, H, K, E, M = 2, 6, 64, 2, 8, 6
    jax_ep.config.update("num_sms", "3")
    emu = _setup(R, S, H, K, E, M, "bf16", 28)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "bf16", 28)
    rpd = M * min(K, E // R)
    emu.reset_counters()
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    assert emu.counters().get("release_stores", 0) == R * E
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    emu.reset_counters()
    c = emu.ll_combine_send(y, d["first_row"], d["row_count"], max_tokens=M, rows_per_dest=rpd)
    assert emu.counters().get("release_stores", 0) == R * E
    emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M)
    counts = emu.counters()
    for name in ("ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send",
                 "ll_combine_recv_plan", "ll_combine_recv"):
        launches = counts.get(f"kernel:{name}:launches", 0)
        if launches:
            assert counts[f"kernel:{name}:blocks"] <= 3 * launches, (name, counts)
    assert counts.get("kernel:ll_combine_recv_plan:blocks", 0) == 3 * R
    assert emu.check_errors() == []


@pytest.mark.emu_full
@pytest.mark.parametrize("first,count", [(None, None), (2**31 - 1, 1), (2**31 - 2, 2**31 - 1)])
def test_ll_handle_past_int32_or_above_rows_per_source_is_foreign(first, count):
    """first_row + row_count above 2^31 (checked in int64), or a handle within y whose
    rows per source pass the call's M * min(K, E_local): foreign, reported on every
    rank."""
    R, S, H, K, E, M = 2, 4, 16, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "f32", 29)
    x, idx, w, y = _inputs(R, S, H, K, E, M, "f32", 29)
    rpd = M * min(K, E // R)
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M)
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    fr, rc = d["first_row"].copy(), d["row_count"].copy()
    if first is None:  # inside y, but more rows for source 0 than the call allows
        fr[0, 0, 0], rc[0, 0, 0] = 0, rpd + 1
    else:
        fr[0, 0, 1], rc[0, 0, 1] = first, count
    c = emu.ll_combine_send(y, fr, rc, max_tokens=M, rows_per_dest=rpd)
    emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M)
    errs = emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == set(range(R)), errs
    assert all("does not belong to this call" in e for e in errs), errs


@pytest.mark.emu_full
def test_ll_rank_in_another_call_errors_instead_of_mixing():
    """Rank 1 runs a dispatch from another call site (another tag): no rows are mixed, a
    call mismatch is reported, and every rank ends with an error."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 30)
    x, idx, _, _ = _inputs(R, S, H, K, E, M, "bf16", 30)
    s = emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M, call_sites=[1, 7])
    d = emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H, dtype=x.dtype,
                             call_sites=[1, 7])
    assert (d["recv_count"] == 0).all() and (d["src_rank"] == -1).all()
    errs = emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == set(range(R)), errs
    assert any("is in another EP call" in e for e in errs), errs


@pytest.mark.emu_full
def test_ll_timeout_after_a_value_error_still_stops_the_send():
    """Rank 0's dispatch has a bad id (a value error, recorded first); then a third send
    before any receive half times out on its credit: the failed state stops that send
    even though the record keeps the first error, so nothing unread is overwritten."""
    R, S, H, K, E, M = 2, 4, 8, 2, 4, 4
    emu = _setup(R, S, H, K, E, M, "bf16", 31, timeout_s=0.002)
    x, idx, _, _ = _inputs(R, S, H, K, E, M, "bf16", 31)
    bad = idx.copy()
    bad[0, 0, 0] = E + 5
    sends = [emu.ll_dispatch_send(x, bad if i == 0 else idx, num_experts=E, max_tokens=M)
             for i in range(3)]
    first = emu.ll_dispatch_recv(sends[0], num_experts=E, max_tokens=M, H=H, dtype=x.dtype)
    errs = emu.check_errors()
    assert any("rank 0]" in e and "is outside" in e for e in errs), errs
    # every rank is in the failed state now: its receive halves move no rows
    assert (first["recv_count"] == 0).all()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == set(range(R)), errs


def _ll_pipelined(emu, rounds, *, E, M):
    """Dispatch rounds enqueued on every rank before one scheduler run: each rank's send
    and receive halves of every round in its stream order, so a fast rank's receive half runs while its peers' send halves still store
    (the ordering the arrival words must give). rounds: list of (x, idx, w, y); the
    receive halves get their epoch (the round's number, as each send half hands it over)
    directly. Returns one result dict per round."""
    from jax_ep._src.emu import _code, EmuError
    R = emu.R
    el = E // R

    def ins(arrs):
        return [(np.ascontiguousarray(a).tobytes(), list(np.shape(a)), _code(np.asarray(a).dtype))
                for a in arrs]

    def outs(spec):
        return [(list(s), _code(d)) for s, d in spec]

    ids = []
    for n, (x, idx, w, y) in enumerate(rounds, start=1):
        S, H, K = x.shape[1], x.shape[2], idx.shape[2]
        rpd = M * min(K, el)
        spec_d = [((el, R * M, H), x.dtype), ((el,), np.int32), ((el, R * M), np.int32),
                  ((el, R * M), np.int32), ((el, R), np.int32), ((el, R), np.int32)]
        per = []
        for r in range(R):
            at = dict(num_experts=E, num_ranks=R, max_tokens=M, call_site=1)
            emu.m.enqueue("ll_dispatch_send", r, ins([x[r], idx[r]]),
                          outs([((0, H), x.dtype), ((S, K), np.int32), ((E,), np.int32)]), at)
            epoch = np.full((S, K), n, np.int32)
            d = emu.m.enqueue("ll_dispatch_recv", r,
                              ins([np.zeros((0, H), x.dtype), epoch, np.zeros(E, np.int32),
                                   *emu._scalars(r)]), outs(spec_d), at)
            per.append((d, spec_d))
        ids.append(per)
    faults = emu.m.synchronize()
    if faults:
        raise EmuError("; ".join(faults))
    results = []
    for per in ids:
        got = []
        for cid, spec in per:
            err, blobs = emu.m.result(cid)
            assert err == "", err
            got.append([np.frombuffer(b, dtype=np.dtype(d)).reshape(s).copy()
                        for b, (s, d) in zip(blobs, spec)])
        results.append({k: np.stack([g[i] for g in got]) for i, k in enumerate(
            ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count"))})
    return results


@pytest.mark.parametrize("R,seed", [(2, 1), pytest.param(2, 2, marks=pytest.mark.emu_full),
                                    pytest.param(4, 3, marks=pytest.mark.emu_full),
                                    pytest.param(4, 4, marks=pytest.mark.emu_full)])
def test_ll_dispatch_halves_in_one_run(R, seed):
    """Send and receive halves of four rounds enqueued together: a receive half that
    reads an arrival word before the rows it covers (no fence, or the word released
    first) reads stale slots in some schedules; with the kernels as they are, every round
    is bit-exact (rows below the counts)."""
    S, H, K, E, M = 6, 256, 2, 2 * R, 6
    emu = _setup(R, S, H, K, E, M, "bf16", seed, resident_blocks=2)
    rounds = [_inputs(R, S, H, K, E, M, "bf16", 100 * seed + i) for i in range(4)]
    rpd = M * min(K, E // R)
    for i, (got, inp) in enumerate(zip(_ll_pipelined(emu, rounds, E=E, M=M), rounds)):
        want = ll_reference(*inp, E=E, M=M, rows_per_dest=rpd)
        assert_ll_same(got, want, LL_DISPATCH_KEYS, f"seed {seed} round {i}: ")
    assert emu.check_errors() == []
