"""Preempted blocks on the emulated GPU (Emulator(preempt_prob=..., preempt_ns=...)): after
each scheduler step the block that ran is parked, with that chance, for that much virtual
time, as a block that an SM deschedules or that waits behind other work. It opens windows
a fair scheduler rarely does: a receiving block that reads its rings long after the rows
were due, while its peers run ahead into the next call. Also: the intranode kernels'
last-block counter over many consecutive calls. Seeds fix the interleaving; a failure
names its seed."""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax_ep

from jax_ep._src.emu import Emulator

from emu_intranode_util import DISPATCH_KEYS, assert_same, bits, reference, routing, rows

pytestmark = pytest.mark.emu


def _case(R, T, H, K, E, C, seed):
    rng = np.random.default_rng(seed)
    idx = routing("random", R, T, K, E, rng)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rows("bf16", (R, C, H), rng)
    g = rows("bf16", (R, T, H), rng)
    return x, idx, w, y, g


def test_preemption_parks_blocks_and_is_off_by_default():
    """The scheduler counts the blocks it parks; with preempt_prob 0 it parks none."""
    R, T, H, K, E, C = 2, 8, 16, 2, 4, 16
    x, idx, w, _, _ = _case(R, T, H, K, E, C, 3)
    for prob, parked in ((0.0, False), (0.01, True)):
        emu = Emulator(R, seed=4, preempt_prob=prob, preempt_ns=20000.0)
        emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
        emu.reset_counters()
        got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
        assert_same(got, reference(x, idx, w, *_case(R, T, H, K, E, C, 3)[3:], E=E, C=C),
                    DISPATCH_KEYS, f"preempt_prob {prob}: ")
        assert (emu.counters().get("preemptions", 0) > 0) == parked
    with pytest.raises(ValueError, match="preempt_prob"):
        Emulator(R, preempt_prob=1.0)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_pipelined_dispatches_with_a_preempted_receiver(seed, monkeypatch):
    """Three dispatches enqueued before the GPUs run, one channel (a sending and a
    receiving block), 2-slot rings, blocks parked for 40 us now and then: a rank's credit
    must wait for its receiving block, which may still be reading this call's rows when
    its sending block is done; a credit sent by the first block to finish lets a peer's
    next call append rows to rings that block reads as this call's."""
    jax_ep.config.update("ring_tokens", "2")
    jax_ep.config.update("num_sms", "2")
    R, T, H, K, E, C = 2, 24, 16, 2, 4, 48
    cases = [_case(R, T, H, K, E, C, 90 + 3 * seed + i) for i in range(3)]
    emu = Emulator(R, seed=seed, resident_blocks=2, preempt_prob=0.002, preempt_ns=40000.0)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    got = emu.dispatch_pipelined([c[:3] for c in cases], num_experts=E, capacity=C)
    for i, (g, c) in enumerate(zip(got, cases)):
        assert_same(g, reference(*c, E=E, C=C), DISPATCH_KEYS, f"seed {seed} call {i}: ")
    assert emu.check_errors() == [], f"seed {seed}"


def test_many_dispatches_leave_the_last_block_counter_at_zero(monkeypatch):
    """Six consecutive dispatches over two channels (four blocks): the last block to finish
    resets the counter each call; a counter never reset holds 4 after the first call, no
    block of the second sees the count it waits for, that call's credit never goes out and
    the third call times out."""
    jax_ep.config.update("num_sms", "4")
    R, T, H, K, E, C = 2, 12, 8, 2, 4, 24
    emu = Emulator(R, seed=5, resident_blocks=4)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    for call in range(6):
        x, idx, w, y, g = _case(R, T, H, K, E, C, 40 + call)
        got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
        assert_same(got, reference(x, idx, w, y, g, E=E, C=C), DISPATCH_KEYS, f"call {call}: ")
        assert emu.check_errors() == [], f"call {call}"


@pytest.mark.parametrize("seed", [4, 7, 11, 15, 28])
def test_a_call_a_preempted_peer_fails_empties_every_output(seed, monkeypatch):
    """Two channels (four blocks per rank), blocks parked for 100 ms, twice the kernels'
    timeout: a rank whose peer's block is parked mid-call times out inside the channel
    kernel. The block that closes the epoch must be the last to finish, so that it sees
    that error and empties every output (the contract's failed call: no row counts as
    received); a rank closing the epoch one block early ends a failed call with rows in
    its outputs (seeds 7, 11, 15, 28: a scan of seeds 1 to 40 on a build of the mutant
    `last_block_counter_bound` found those and 17, 19, 40). A rank without an error of
    its own is not checked here: a peer that fails after passing this call's site check
    may have sent only part of its rows, and this rank learns of it in its next call."""
    jax_ep.config.update("num_sms", "4")
    R, T, H, K, E, C = 2, 24, 8, 2, 4, 48
    rng = np.random.default_rng(seed)
    idx = routing("random", R, T, K, E, rng)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    emu = Emulator(R, seed=seed, resident_blocks=4, preempt_prob=3e-4, preempt_ns=1e8)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    got = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    errs = emu.check_errors()
    failed = {int(m.group(1)) for e in errs for m in [re.search(r"\[GPU (\d+),", e)] if m}
    assert failed, f"seed {seed}: no call failed (the seed no longer parks a block mid-call)"
    for r in sorted(failed):
        what = f"seed {seed} rank {r}"
        assert int(got["num_recv"][r]) == 0 and int(got["num_dropped"][r]) == 0, what
        assert (got["src_rank"][r] == -1).all() and (got["recv_idx"][r] == -1).all(), what
        assert not bits(got["recv_x"][r]).any() and (got["per_expert"][r] == 0).all(), what
