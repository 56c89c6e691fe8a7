"""The intranode CUDA kernels (kernels/cuda/layout_kernels.cu, intranode_kernels.cu) run on
the emulated GPU through the CUDA backend's own handlers, bit for bit against the
reference backend. Seeds fix the interleaving; a failure names its seed."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jax_ep

from jax_ep._src.backends import reference as reference_backend
from jax_ep._src.common import Cfg
from jax_ep._src.emu import Emulator

from emu_intranode_util import (DISPATCH_KEYS, assert_same, reference, routing, rows,
                                run_intranode)

pytestmark = pytest.mark.emu


def _case(R, T, H, K, E, C, dtype, kind, seed):
    rng = np.random.default_rng(seed)
    idx = routing(kind, R, T, K, E, rng)
    x = rows(dtype, (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    ydt = "bf16" if dtype == "fp8" else dtype
    y = rows(ydt, (R, C, H), rng)
    g = rows(dtype, (R, T, H), rng)
    return x, idx, w, y, g


def _check(emu, x, idx, w, y, g, E, C, what):
    got = run_intranode(emu, x, idx, w, y, g, E=E, C=C)
    want = reference(x, idx, w, y, g, E=E, C=C)
    keys = DISPATCH_KEYS + ("gather",) + (("out",) if x.dtype != np.uint8 else ())
    assert_same(got, want, keys, what)
    errs = emu.check_errors()
    assert errs == [], f"{what}unexpected device errors: {errs}"


@pytest.mark.parametrize("R,T,E,seed", [(2, 16, 4, 1), (4, 9, 8, 2)])
def test_layout(R, T, E, seed):
    emu = Emulator(R, seed=seed)
    idx = routing("random", R, T, 3, E, np.random.default_rng(seed))
    got = emu.layout(idx, num_experts=E)
    for r in range(R):
        want = reference_backend.layout(idx[r], Cfg(E, R))
        np.testing.assert_array_equal(got["per_rank"][r], want.num_tokens_per_rank)
        np.testing.assert_array_equal(got["per_expert"][r], want.num_tokens_per_expert)
        np.testing.assert_array_equal(got["in_rank"][r], want.is_token_in_rank)
    assert emu.check_errors() == []


def test_layout_bad_id_is_recorded():
    emu = Emulator(2, seed=3)
    idx = routing("random", 2, 8, 2, 4, np.random.default_rng(3))
    idx[1, 5, 1] = 9
    got = emu.layout(idx, num_experts=4)
    errs = emu.check_errors()
    assert len(errs) == 1 and "topk_idx[5, 1] = 9" in errs[0] and "GPU 1" in errs[0], errs
    fixed = np.where(idx == 9, -1, idx)
    want = reference_backend.layout(fixed[1], Cfg(4, 2))
    np.testing.assert_array_equal(got["per_expert"][1], want.num_tokens_per_expert)


# (R, T, H, K, E, C, dtype, routing, seed): QUICK, the cases a `-m "not emu_full"` run keeps.
QUICK = [
    (2, 12, 40, "bf16", "random", 1),
    (4, 6, 20, "f32", "skewed", 2),
]
FULL = [
    (2, 1, 8, "f32", "random", 3),          # T = 1
    (2, 10, 3, "bf16", "random", 4),        # rows of 6 bytes: not a multiple of 16
    (2, 10, 24, "f16", "collapsed", 5),
    (4, 8, 16, "bf16", "none", 6),          # every id -1
    (4, 8, 16, "bf16", "silent_rank", 7),   # rank 3 receives nothing but sends
    (2, 9, 64, "fp8", "random", 8),         # FP8 pairs: H + 4 H / 32 bytes per row
    (8, 5, 8, "f32", "random", 9),
]


def _shape(R, T, E_per=2, K=3):
    E = R * E_per
    return K, E


@pytest.mark.parametrize("R,T,H,dtype,kind,seed", QUICK)
def test_dispatch_combine_gather(R, T, H, dtype, kind, seed):
    K, E = _shape(R, T)
    C = R * T  # room for every row
    emu = Emulator(R, seed=seed)
    # FP8 pairs are dispatched as packed rows and combined as bfloat16 rows of H.
    row_bytes = max(rows(dtype, (1, 1, H), np.random.default_rng(0)).nbytes, 2 * H)
    emu.setup(tokens=T, capacity=C, row_bytes=row_bytes, topk=K)
    _check(emu, *_case(R, T, H, K, E, C, dtype, kind, seed), E, C, f"seed {seed}: ")


@pytest.mark.emu_full
@pytest.mark.parametrize("R,T,H,dtype,kind,seed", FULL)
def test_dispatch_combine_gather_full(R, T, H, dtype, kind, seed):
    test_dispatch_combine_gather(R, T, H, dtype, kind, seed)


@pytest.mark.emu_full
@pytest.mark.parametrize("R", [16, 18])
def test_dispatch_combine_gather_both_sides_of_the_send_split(R):
    """16 ranks: both blocks of a channel send (8 sending warps, then 16 receiving ones in
    block 2ch + 1); 18 (past kMaxSplitSendRanks): block 2ch sends to every rank and block
    2ch + 1 only receives. Bit-exact against the reference, which needs R CPU devices: in a
    process of its own (about a minute or two each)."""
    child = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "import test_intranode_emu as t\n"
        "from jax_ep._src.emu import Emulator\n"
        "R, T, H = int(sys.argv[1]), 6, 16\n"
        "K, E = t._shape(R, T)\n"
        "C = R * T\n"
        "emu = Emulator(R, seed=5)\n"
        "emu.setup(tokens=T, capacity=C, row_bytes=2 * H, topk=K)\n"
        "t._check(emu, *t._case(R, T, H, K, E, C, 'bf16', 'random', 5), E, C, f'R {R}: ')\n"
        "print('bit-exact')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=32")
    r = subprocess.run([sys.executable, "-c", child, str(R), here, os.path.dirname(here)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0 and "bit-exact" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.emu_full
@pytest.mark.parametrize("resident_blocks", [2, 16])
def test_capacity_overflow_and_consecutive_calls(resident_blocks):
    """C below the rows that arrive (drops), four calls in a row on one group with new data
    each time (epochs advance, credits and requests are reused), two co-residency limits."""
    R, T, H, K, E, C = 4, 10, 16, 2, 8, 7
    emu = Emulator(R, seed=11, resident_blocks=resident_blocks)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    for call in range(4):
        case = _case(R, T, H, K, E, C, "bf16", "skewed" if call % 2 else "random", 20 + call)
        _check(emu, *case, E, C, f"call {call}: ")


def test_pipelined_dispatches_wait_for_credits():
    """Three dispatches enqueued on every rank before the GPUs run: a fast rank's next push
    must wait for each receiver's credit (it finished reading the previous epoch)."""
    R, T, H, K, E, C = 2, 8, 16, 2, 4, 16
    cases = [_case(R, T, H, K, E, C, "bf16", "random", 50 + i) for i in range(3)]
    for seed in (1, 2):
        emu = Emulator(R, seed=seed)
        emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
        got = emu.dispatch_pipelined([c[:3] for c in cases], num_experts=E, capacity=C)
        for i, (g, c) in enumerate(zip(got, cases)):
            assert_same(g, reference(*c, E=E, C=C), DISPATCH_KEYS, f"seed {seed} call {i}: ")
        assert emu.check_errors() == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pipelined_dispatches_one_channel_small_rings(seed, monkeypatch):
    """Three dispatches enqueued before the GPUs run, one channel (num_sms 2) and rings of
    2 slots: a rank's credit must wait for its receiving block, or a peer's next epoch
    writes into a ring that block still drains for this one."""
    jax_ep.config.update("ring_tokens", "2")
    jax_ep.config.update("num_sms", "2")
    R, T, H, K, E, C = 2, 24, 16, 2, 4, 48
    cases = [_case(R, T, H, K, E, C, "bf16", "random", 80 + i) for i in range(3)]
    emu = Emulator(R, seed=seed, resident_blocks=2)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    got = emu.dispatch_pipelined([c[:3] for c in cases], num_experts=E, capacity=C)
    for i, (g, c) in enumerate(zip(got, cases)):
        assert_same(g, reference(*c, E=E, C=C), DISPATCH_KEYS, f"seed {seed} call {i}: ")
    assert emu.check_errors() == []


def test_rows_in_every_block_over_consecutive_calls():
    """Enough rows that every warp of every push block copies some, two calls in a row:
    a signal sent before the last block's rows (or a stale last-block counter) shows."""
    R, T, H, K, E, C = 2, 600, 4, 2, 4, 1200
    emu = Emulator(R, seed=16)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 4, topk=K)
    for call in range(2):
        case = _case(R, T, H, K, E, C, "f32", "random", 60 + call)
        _check(emu, *case, E, C, f"call {call}: ")


def test_seeds_agree():
    """Different interleavings and store-buffer drains, one result: the protocol's fences
    and signals order every peer write before its reader."""
    R, T, H, K, E, C = 2, 8, 16, 2, 4, 16
    case = _case(R, T, H, K, E, C, "bf16", "random", 5)
    outs = []
    for seed in (1, 2, 3):
        emu = Emulator(R, seed=seed)
        emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
        outs.append(run_intranode(emu, *case, E=E, C=C))
    want = reference(*case, E=E, C=C)
    for o in outs:
        assert_same(o, want, DISPATCH_KEYS + ("out", "gather"))


# ---------------------------------------------------------------------------- faults

def test_bad_id_is_recorded_and_treated_as_unused():
    R, T, H, K, E, C = 2, 8, 16, 2, 4, 16
    x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "random", 12)
    idx[0, 3, 1] = -7
    emu = Emulator(R, seed=12)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    errs = emu.check_errors()
    # The rank with the bad id names it; its peer learns it from the header exchange
    # (no collective of XLA's carries the verdict).
    by_gpu = {g: [e for e in errs if f"[GPU {g}," in e] for g in range(R)}
    assert len(errs) == 2 and all(len(v) == 1 for v in by_gpu.values()), errs
    assert "topk_idx[3, 1] = -7" in by_gpu[0][0], errs
    assert "rank 0's topk_idx holds ids outside" in by_gpu[1][0], errs
    fixed = np.where(idx == -7, -1, idx)
    want = reference(x, fixed, w, y, g, E=E, C=C)
    assert_same(got, want, DISPATCH_KEYS)
    # The verdict is per call: the next call, with good ids, reports nothing.
    again = emu.dispatch(x, fixed, w, num_experts=E, capacity=C)
    assert emu.check_errors() == []
    assert_same(again, want, DISPATCH_KEYS)


def test_rank_that_skips_a_call_ends_in_errors_on_every_rank():
    """Rank 1 makes no dispatch: rank 0 times out (its own timeout, in virtual time) and
    moves no data; in the next call rank 1 is a call behind and every rank reports."""
    R, T, H, K, E, C = 2, 6, 16, 2, 4, 12
    x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "random", 13)
    emu = Emulator(R, seed=13, timeout_s=0.002)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=C, skip=[1])
    errs = emu.check_errors()
    assert any("timed out" in e.lower() or "timeout" in e.lower() for e in errs), errs
    assert d["num_recv"][0] == 0 and (d["src_rank"][0] == -1).all()
    emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    errs += emu.check_errors()
    ranks = {r for r in range(R) for e in errs if f"rank {r}]" in e}
    assert ranks == {0, 1}, errs


def test_call_site_mismatch_is_reported():
    R, T, H, K, E, C = 2, 6, 16, 2, 4, 12
    x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "random", 14)
    emu = Emulator(R, seed=14)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=C, call_sites=[5, 6])
    errs = emu.check_errors()
    assert any("another EP call" in e for e in errs), errs
    assert (d["num_recv"] == 0).all()


def test_counters_report_the_launches():
    """Blocks and warps per kernel, as the presets launch them (counted, not measured): a
    notify block and 2 x channels blocks; gather's of one warp per peer (at least 8),
    dispatch's (a channel per block) of a sending warp per rank beside one receiving warp
    per peer (at least 8)."""
    R, T, H, K, E, C = 2, 4, 16, 2, 4, 8
    emu = Emulator(R, seed=15)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "random", 15)
    emu.reset_counters()
    emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    c = emu.counters()
    preset = next(p for p in emu.m.cuda_presets() if R <= p["max_ranks"])
    assert c["kernel:dispatch_notify_kernel:launches"] == R
    assert c["kernel:dispatch_channel_kernel:blocks"] == R * preset["num_sms"]
    assert c["kernel:dispatch_channel_kernel:warps"] == R * preset["num_sms"] * (R + 8)
    assert not any(k.startswith(("kernel:dispatch_push", "kernel:dispatch_finish")) for k in c)
    assert c["release_stores"] >= 2 * R * R  # arrivals and credits, one per peer
    assert c["fences:system"] > 0 and c["polls"] > 0
    # Gather (cached dispatch): the channel kernel alone, no notify, plan, push or finish.
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    emu.reset_counters()
    emu.gather(g, d["src_rank"], d["src_index"])
    c = emu.counters()
    assert c["kernel:gather_channel_kernel:launches"] == R
    assert c["kernel:gather_channel_kernel:blocks"] == R * preset["num_sms"]
    assert c["kernel:gather_channel_kernel:warps"] == R * preset["num_sms"] * (1 + 8)
    assert [k for k in c if k.startswith("kernel:") and "gather_channel" not in k] == []


@pytest.mark.parametrize("seed", [21, 22])
def test_dispatch_bulk_copies_in_pieces(seed, monkeypatch):
    """Dispatch moves rows as bulk copies (the TMA) through two staging pieces per source;
    with 32-byte pieces an 80-byte row goes as 32 + 32 + 16, so piece p + 1 loads while
    piece p stores, and the mbarrier phases carry over rows, ring wraps (2 slots) and
    calls. Every output row is stored by bulk copies exactly once (received rows and the
    zeros past them), and every row loaded once: counted, per GPU. 96 tokens: the 20
    dispatch channels at 4 ranks (a block each) then hold about 5 tokens, so a receiving
    warp copies several rows one after another through the same pieces."""
    jax_ep.config.update("bulk_piece_bytes", "32")
    jax_ep.config.update("ring_tokens", "2")
    R, T, H, K, E = 4, 96, 40, 2, 8
    emu = Emulator(R, seed=seed)
    row = H * 2
    for call, C in enumerate((3 * T, T // 2)):  # room for every row, then overflow
        emu.setup(tokens=T, capacity=C, row_bytes=row, topk=K)
        x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "skewed" if call else "random",
                                seed + call)
        emu.reset_counters()
        got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
        want = reference(x, idx, w, y, g, E=E, C=C)
        assert_same(got, want, DISPATCH_KEYS, f"seed {seed} call {call}: ")
        assert emu.check_errors() == []
        for r in range(R):
            c = emu.counters(r)
            kept = int(np.asarray(got["num_recv"])[r])
            assert c.get("tma_bytes:load:local", 0) == kept * row, (r, c)
            assert c.get("tma_bytes:store:local", 0) == C * row, (r, c)


# ------------------------------------------------------------------------------ rings

def _ring_rows(emu, op):
    """Rows that went through each (rank, channel, peer) ring so far: its tail."""
    return np.array([emu.m.intranode_ring_counters(r, op)["tail"] for r in range(emu.R)])


@pytest.mark.parametrize("resident_blocks", [2, 8])
def test_rings_wrap_within_and_across_calls(resident_blocks, monkeypatch):
    """Rings of 2 slots: every (channel, peer) ring of dispatch, combine and gather (cached
    dispatch) but a rank's own (its own rows skip it, and it stays put) wraps at least 3
    times in one call and again in the next, bit for bit against the reference, with two
    co-residency limits (2: a combine channel's two blocks, or two dispatch channels, at a
    time). 256 tokens: dispatch's 16 channels (a block each) bring about 12 rows a ring."""
    jax_ep.config.update("ring_tokens", "2")
    R, T, H, K, E, C = 2, 256, 16, 3, 4, 512
    emu = Emulator(R, seed=21, resident_blocks=resident_blocks)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    area = emu.m.cuda_area_bytes(R, T, C, H * 2, K)
    # dispatch runs a channel per block, combine and gather one per two blocks
    nch = {0: area["dispatch_channels"], 1: area["channels"], 2: area["channels"]}
    ops = (0, 1, 2)
    before = [_ring_rows(emu, op)[:, :nch[op], :R] for op in ops]
    for call in range(2):
        case = _case(R, T, H, K, E, C, "bf16", "random", 70 + call)
        _check(emu, *case, E, C, f"call {call}: ")
        for op in ops:
            now = _ring_rows(emu, op)[:, :nch[op], :R]
            wraps = (now - before[op]) // 2
            # a rank's own rows skip its ring (ch, me) in every op: it stays put
            own = np.arange(R)
            assert (now[own, :, own] == before[op][own, :, own]).all(), (op, call, now)
            wraps = np.stack([wraps[r, :, p] for r in range(R) for p in range(R) if p != r])
            assert wraps.min() >= 3, (op, call, wraps)
            before[op] = now
        # every slot handed back: what each receiver read is what its sender wrote (gather's
        # head: the ids the receiver posted, each answered by a row)
        for op in ops:
            k = [emu.m.intranode_ring_counters(r, op) for r in range(R)]
            for d in range(R):
                for s in range(R):
                    for ch in range(nch[op]):
                        assert k[d]["tail"][ch][s] == k[d]["read"][ch][s] == k[s]["sent"][ch][d]
                        assert k[s]["head"][ch][d] == k[s]["sent"][ch][d]


def test_rings_full_at_four_ranks_every_role_waits_on_its_own_barrier(monkeypatch):
    """Rings of 2 slots at 4 ranks: the odd ranks' sending warps (in block 2ch + 1, beside
    the receiving ones) wait for each other's receivers, 1 for 3 and 3 for 1. Receiving
    warps that met at the whole block's barrier would wait for those senders: a deadlock
    (at 2 ranks the odd block's only sender is the rank itself, which skips its ring, so
    no cycle forms there). Bit for bit against the reference, no device errors."""
    jax_ep.config.update("ring_tokens", "2")
    R, T, H, K, E, C = 4, 48, 16, 3, 8, 4 * 48
    emu = Emulator(R, seed=23)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    _check(emu, *_case(R, T, H, K, E, C, "bf16", "random", 80), E, C, "4 ranks: ")


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_rows_of_several_copy_engine_pieces(dtype, monkeypatch):
    """Rows of 10400 bytes: 650 16-byte vectors, which a warp's copy (copy_engine.cuh, 8
    vectors a lane in flight, 256 a piece) moves as two full pieces and a partial one, in
    the sends of all three ops, gather's received rows and combine's sums; rings of 2
    slots, so each slot is rewritten while the kernel runs (a stale line of a slot read
    through the non-coherent path would show). Bit for bit against the reference."""
    jax_ep.config.update("ring_tokens", "2")
    R, T, K, E = 2, 24, 2, 4
    H = 10400 // (2 if dtype == "bf16" else 4)
    C = R * T
    emu = Emulator(R, seed=41)
    emu.setup(tokens=T, capacity=C, row_bytes=10400, topk=K)
    _check(emu, *_case(R, T, H, K, E, C, dtype, "random", 41), E, C, f"{dtype}: ")


def test_default_grid_and_staging_do_not_grow_with_tokens():
    """At 8 ranks the default channel kernels use at most 24 blocks (DeepEP's 20-24 SMs),
    a launch runs that many, and the staging the setup reports is the same for 4096 and
    65536 tokens per rank (computed for those shapes, not run)."""
    emu = Emulator(8, seed=22)
    ep8 = next(p for p in emu.m.cuda_presets() if p["max_ranks"] >= 8)
    assert 2 <= ep8["num_sms"] <= 24
    H, K = 7168, 8
    small = emu.m.cuda_area_bytes(8, 4096, 8 * 4096, H * 2, K)
    big = emu.m.cuda_area_bytes(8, 65536, 8 * 65536, H * 2, K)
    for op in ("dispatch", "combine", "gather"):
        assert small[op] == big[op], op
    assert small["channels"] == ep8["num_sms"] // 2
    assert small["dispatch_channels"] == ep8["num_sms"]  # a channel per block
    q, row = small["ring_tokens"], H * 2
    # rings of 128 rows x 8 peers x dispatch channels: the rows, their ids and weights
    assert small["dispatch"] >= small["dispatch_channels"] * 8 * q * (row + 8 * 8 + 8)
    # gather: a data ring and a ring of token ids per (channel, peer), nothing per token
    ring = -(-q * row // 256) * 256 + -(-q * 4 // 256) * 256
    assert small["gather"] == small["channels"] * 8 * ring
    R, T, Hs, E, C = 8, 6, 8, 16, 48
    emu.setup(tokens=T, capacity=C, row_bytes=Hs * 4, topk=2)
    x, idx, w, y, g = _case(R, T, Hs, 2, E, C, "f32", "random", 22)
    emu.reset_counters()
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    c = emu.counters()
    assert c["kernel:dispatch_channel_kernel:blocks"] == R * ep8["num_sms"]
    want = reference(x, idx, w, y, g, E=E, C=C)
    assert_same(d, want, DISPATCH_KEYS)
    emu.reset_counters()
    got = emu.gather(g, d["src_rank"], d["src_index"])
    assert emu.counters()["kernel:gather_channel_kernel:blocks"] == R * ep8["num_sms"]
    assert_same({"gather": got}, want, ("gather",))


@pytest.mark.parametrize("before", [None, "123"])
def test_emulator_leaves_the_process_timeout_alone(before):
    """The emulator's own timeout applies to its launches only: the timeout setting (the
    emulated module's copy of jax_ep.config.timeout_s, and the CPU transport's) is the
    same after an emulated call."""
    from jax_ep._src import emu as _emu
    from jax_ep._src.ext import require_ext
    jax_ep.config.update("timeout_s", before)
    want = jax_ep.config.current().timeout_s
    emu = Emulator(2, seed=5)
    emu.layout(routing("random", 2, 4, 2, 4, np.random.default_rng(5)), num_experts=4)
    assert _emu.module().settings()["timeout_s"] == want
    assert require_ext().settings()["timeout_s"] == want


# ------------------------------------------------------------ gather (cached dispatch)

def _dispatched(emu, seed, R, T, H, K, E, C, dtype="bf16", kind="random"):
    """A dispatch on the emulated GPU, its case and the reference's results."""
    case = _case(R, T, H, K, E, C, dtype, kind, seed)
    d = emu.dispatch(*case[:3], num_experts=E, capacity=C)
    return d, case, reference(*case, E=E, C=C)


@pytest.mark.parametrize("T", [0, 1])
def test_gather_with_no_or_one_token(T):
    """T = 0 (nothing received: every row zero; the reference cannot index an empty g)
    and T = 1, twice each, so the epochs and counters of empty rings advance too."""
    R, H, K, E, C = 4, 16, 2, 8, 4
    emu = Emulator(R, seed=30 + T)
    emu.setup(tokens=max(T, 1), capacity=C, row_bytes=H * 2, topk=K)
    for call in range(2):
        case = _case(R, T, H, K, E, C, "bf16", "random", 30 + T + call)
        d = emu.dispatch(*case[:3], num_experts=E, capacity=C)
        got = emu.gather(case[4], d["src_rank"], d["src_index"])
        if T == 0:
            assert (d["num_recv"] == 0).all() and (d["src_rank"] == -1).all()
            assert got.shape == (R, C, H) and (got == 0).all()
        else:
            assert_same({"gather": got}, reference(*case, E=E, C=C), ("gather",))
        assert emu.check_errors() == []


@pytest.mark.parametrize("resident_blocks", [2, None])
def test_gather_skewed_routing_and_capacity_overflow(resident_blocks, monkeypatch):
    """Most rows to rank 0 and more than C of them (the last ones dropped), rings of 3
    slots, three gathers of one handle in a row (cached dispatch reuses it)."""
    jax_ep.config.update("ring_tokens", "3")
    R, T, H, K, E, C = 4, 24, 8, 2, 8, 30
    kw = {} if resident_blocks is None else dict(resident_blocks=resident_blocks)
    emu = Emulator(R, seed=31, **kw)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 4, topk=K)
    d, case, want = _dispatched(emu, 31, R, T, H, K, E, C, dtype="f32", kind="skewed")
    assert (want["num_dropped"] > 0).any()
    rng = np.random.default_rng(31)
    for call in range(3):
        g = rows("f32", (R, T, H), rng)
        want = reference(*case[:4], g, E=E, C=C)
        got = emu.gather(g, d["src_rank"], d["src_index"])
        assert_same({"gather": got}, want, ("gather",), f"call {call}: ")
    assert emu.check_errors() == []


def test_gather_foreign_handle_is_reported_and_its_rows_are_zero(monkeypatch):
    """One channel; rank 1's first and last received rows swapped (not a handle from
    dispatch: neither source's rows are contiguous any more): rank 1 reports the handle and
    leaves those rows zero, rank 0 still gets its rows."""
    jax_ep.config.update("num_sms", "2")
    R, T, H, K, E, C = 2, 8, 16, 2, 4, 16
    emu = Emulator(R, seed=32)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    d, case, want = _dispatched(emu, 32, R, T, H, K, E, C)
    src_rank, src_index = d["src_rank"].copy(), d["src_index"].copy()
    n = int(d["num_recv"][1])
    assert (src_rank[1, :n] == 0).sum() >= 2 and (src_rank[1, :n] == 1).sum() >= 2
    for a in (src_rank, src_index):
        a[1, [0, n - 1]] = a[1, [n - 1, 0]]
    got = emu.gather(case[4], src_rank, src_index)
    errs = emu.check_errors()
    assert any("handle" in e and "GPU 1" in e for e in errs), errs
    assert not any("GPU 0" in e for e in errs), errs
    assert_same({"gather": got[0]}, {"gather": want["gather"][0]}, ("gather",))
    assert (got[1] == 0).all()
    # The rings stayed in step: the next gather with the true handle is bit-exact.
    got = emu.gather(case[4], d["src_rank"], d["src_index"])
    assert_same({"gather": got}, want, ("gather",))
    assert emu.check_errors() == []


def test_gather_call_site_mismatch_is_reported(monkeypatch):
    """Ranks in different calls: each reports the other's call and nothing moves; every
    ring still ends where both sides agree (rings of 2 slots, more rows than slots: a
    sender that streamed rows to a receiver that skipped its ring would be left waiting)."""
    jax_ep.config.update("ring_tokens", "2")
    jax_ep.config.update("num_sms", "2")
    R, T, H, K, E, C = 2, 12, 16, 2, 4, 24
    emu = Emulator(R, seed=33, timeout_s=0.002)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    d, case, _ = _dispatched(emu, 33, R, T, H, K, E, C)
    assert (d["num_recv"] > 2).all()
    got = emu.gather(case[4], d["src_rank"], d["src_index"], call_sites=[5, 6])
    errs = emu.check_errors()
    assert any("another EP call" in e for e in errs), errs
    k = [emu.m.intranode_ring_counters(r, 2) for r in range(R)]
    for q in range(R):
        for s in range(R):
            assert k[q]["read"][0][s] == k[s]["sent"][0][q], (q, s)
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == {0, 1}, errs
    assert (got == 0).all()


def test_gather_rank_that_skips_a_call_then_reset():
    """Rank 1 makes no gather: rank 0 times out and moves no data; in the next gather
    every rank reports and nothing moves; after reset() a gather is bit-exact again."""
    R, T, H, K, E, C = 2, 6, 16, 2, 4, 12
    emu = Emulator(R, seed=34, timeout_s=0.002)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    d, case, want = _dispatched(emu, 34, R, T, H, K, E, C)
    got = emu.gather(case[4], d["src_rank"], d["src_index"], skip=[1])
    errs = emu.check_errors()
    assert any("timed out" in e for e in errs), errs
    assert (got[0] == 0).all()
    got = emu.gather(case[4], d["src_rank"], d["src_index"])
    errs += emu.check_errors()
    assert {r for r in range(R) for e in errs if f"rank {r}]" in e} == {0, 1}, errs
    assert (got == 0).all()
    emu.m.cuda_reset()
    got = emu.gather(case[4], d["src_rank"], d["src_index"])
    assert emu.check_errors() == []
    assert_same({"gather": got}, want, ("gather",))
