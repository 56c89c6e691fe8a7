"""The emulated NCCL GIN (kernels/emu/nccl_emu.h) as an instrument: each rule of its model
holds for code that keeps the rule and is caught, in some seed or at once, for code that
breaks it. The probe kernels and ops are xla_ffi/internode/emu_gin_probe.cc; the model is
docs/emulator.md, "NCCL GIN (emulated)"."""
from __future__ import annotations

import re

import numpy as np
import pytest

from jax_ep._src.emu import EmuError, Emulator

LOG_COLS = ("src", "dst", "context", "port", "devcomm", "block", "bytes", "kind", "call", "done")
PUT, PUT_STRONG, PUT_WEAK, SIGNAL_STRONG, SIGNAL_WEAK = range(5)  # nccl_emu::LogKind
VISIBILITY, OVERWRITE, CONTEXTS, RAIL, PEER_PTRS, CONTEXT, KINDS, DIVERGENT = range(8)  # cases
SEEDS = range(12)


class Gin:
    """An emulated NCCL world of R ranks (G per node), rank r on virtual GPU r, every comm
    made by one host thread in one group, with FULL and RAIL devComms of `contexts`."""

    def __init__(self, R=2, *, G=1, seed=1, max_delay=64, settle_delay=1024, max_contexts=4,
                 contexts=2, size_mismatch=False):
        self.R = R
        self.emu = Emulator(R, seed=seed, resident_blocks=4)
        one = dict(skip=range(1, R))
        world = dict(num_ranks=R, gpus_per_node=G, seed=seed, max_delay=max_delay,
                     settle_delay=settle_delay, max_contexts=max_contexts)
        _, errs = self.emu.run("gin_world", [[]] * R, [[]] * R, world, **one)
        assert not errs[0], errs[0]
        res, errs = self.emu.run("gin_init", [[]] * R, [[((1,), np.int32)]] * R,
                                 dict(num_ranks=R, contexts=contexts,
                                      size_mismatch=int(size_mismatch)), **one)
        if errs[0]:
            raise RuntimeError(errs[0])
        self.granted = int(res[0][0][0])

    def probe(self, case, x, *, peer=1, sig=0, flush=0, ctx=0, ranks=None):
        """Runs probe `case` on `ranks` (default all); x[rows, row_bytes] u8 is the sender's
        rows. Returns (rows the receiver read, its timeout flag or the peer-pointer flags)
        per rank (None where it did not run)."""
        R = self.R
        rows, rb = x.shape
        skip = [r for r in range(R) if ranks is not None and r not in ranks]
        res, errs = self.emu.run(
            "gin_probe", [[x]] * R, [[((rows, rb), np.uint8), ((R,), np.int32)]] * R,
            dict(case=case, peer=peer, rows=rows, row_bytes=rb, sig=sig, flush=flush, ctx=ctx),
            skip=skip, per_rank_attrs=[dict(rank=r) for r in range(R)])
        assert not any(errs), errs
        return res

    def log(self):
        one = dict(skip=range(1, self.R))
        res, _ = self.emu.run("gin_log_size", [[]] * self.R, [[((2,), np.int32)]] * self.R, {},
                              **one)
        n, pending = (int(v) for v in res[0][0])
        res, _ = self.emu.run("gin_log", [[]] * self.R,
                              [[((n, len(LOG_COLS)), np.int32)]] * self.R, {}, **one)
        return [dict(zip(LOG_COLS, (int(v) for v in row))) for row in res[0][0]], pending


def rows(seed, n=6, rb=64):
    return (np.random.default_rng(seed).integers(1, 256, (n, rb))).astype(np.uint8)


def received(g, x, **kw):
    res = g.probe(VISIBILITY, x, **kw)
    out, flags = res[1]
    assert flags[0] == 0, "the receiver's wait timed out"
    return out


@pytest.mark.parametrize("sig", [1, 3], ids=["put_strong", "signal_strong"])
def test_strong_signal_settles_every_earlier_put(sig):
    # gin.h:160: a strong signal "guarantees this put AND all preceding puts on this context
    # to the same peer are settled": the receiver that saw it reads every row, every seed.
    for seed in SEEDS:
        x = rows(seed)
        out = received(Gin(seed=seed), x, sig=sig)
        np.testing.assert_array_equal(out, x, err_msg=f"seed {seed}")


@pytest.mark.parametrize("sig", [2, 4], ids=["put_weak", "signal_weak"])
def test_weak_signal_after_unsignalled_puts_is_caught(sig):
    # gin.h:28, 45, 162: a weak signal "guarantees only the bundled put is settled": code that
    # waits for one and reads the earlier rows reads stale rows in some seeds.
    stale = 0
    for seed in SEEDS:
        x = rows(seed)
        out = received(Gin(seed=seed), x, sig=sig)
        if sig == 2:  # its own row is settled before the signal
            np.testing.assert_array_equal(out[-1], x[-1], err_msg=f"seed {seed}")
        stale += int(not np.array_equal(out, x))
    assert stale >= 1, "no seed showed the missing strong signal"


def test_source_rewritten_before_flush_sends_new_bytes():
    # The NIC reads the source when it processes the put; flush returns once it has
    # ("All source buffers ... will be safe to reuse", gin.h:234).
    new_seen = 0
    for seed in SEEDS:
        x = rows(seed, n=1)
        for flush in (0, 1):
            out, flags = Gin(seed=seed).probe(OVERWRITE, x, flush=flush)[1]
            assert flags[0] == 0
            if flush:
                np.testing.assert_array_equal(out, x, err_msg=f"seed {seed}")
            else:
                # old or new bytes, or a mix: the NIC may read the rewrite half done
                assert np.all((out == x) | (out == ~x))
                new_seen += int(not np.array_equal(out, x))
    assert new_seen >= 1, "no seed sent the rewritten source"


def test_in_order_per_context_reordered_across_contexts():
    crossed = 0
    for seed in SEEDS:
        g = Gin(seed=seed, contexts=2)
        x = rows(seed, n=8, rb=32)
        out, flags = g.probe(CONTEXTS, x)[1]
        assert flags[0] == 0
        np.testing.assert_array_equal(out, x)
        log, _ = g.log()
        assert [r["context"] for r in log] == [k % 2 for k in range(8)]
        assert all(r["done"] > 0 for r in log)
        for c in (0, 1):
            done = [r["done"] for r in log if r["context"] == c]
            assert done == sorted(done), f"seed {seed}: context {c} processed out of order"
        crossed += int(any(a["done"] > b["done"] for i, a in enumerate(log)
                           for b in log[i + 1:] if a["context"] != b["context"]))
    assert crossed >= 1, "no seed processed a later context's operation first"


def test_rail_devcomm_refuses_a_non_rail_peer():
    x = rows(0, n=1)
    g = Gin(R=4, G=2)
    g.probe(RAIL, x, peer=2, ranks=[0])  # rank 2: node 1, local index 0, as rank 0
    g = Gin(R=4, G=2)
    with pytest.raises(EmuError, match=r"RAIL connects only the ranks with the same local "
                                       r"index .* rank 1 is not connected"):
        g.probe(RAIL, x, peer=1, ranks=[0])


def test_contexts_granted_are_at_most_max_contexts():
    g = Gin(contexts=4, max_contexts=2)
    assert g.granted == 2  # ginContextCount is a hint (host.h:50)
    x = rows(0, n=1)
    g.probe(CONTEXT, x, ctx=1, ranks=[0])
    with pytest.raises(EmuError, match="context 2 of a devComm granted 2 contexts"):
        g.probe(CONTEXT, x, ctx=2, ranks=[0])


def test_peer_pointer_only_within_the_node():
    g = Gin(R=4, G=2)
    res = g.probe(PEER_PTRS, rows(0, n=1))
    for r in range(4):
        assert list(res[r][1]) == [int(p // 2 == r // 2) for p in range(4)], f"rank {r}"


def test_window_size_mismatch_is_an_error():
    with pytest.raises(RuntimeError, match=r"invalid argument.*window size mismatch: rank 1 "
                                           r"registers window 0"):
        Gin(size_mismatch=True)


@pytest.mark.parametrize("case,text", [
    (0, r"invalid argument.*: ncclCommInitRank: rank 2 out of range \[0, 2\)"),
    (1, r"invalid usage.*: ncclCommInitRank: duplicate rank 0"),
    (2, r"invalid argument.*: ncclCommInitRank: mismatched nranks: rank 1 passes 3"),
    (3, r"invalid usage.*: ncclCommWindowRegister: communicator not initialized"),
    (4, r"ncclGroupEnd\(\): invalid argument .*rank 7 out of range"),
], ids=["rank_range", "duplicate_rank", "nranks", "before_init", "in_group"])
def test_host_misuse_is_refused(case, text):
    g = Gin(R=3)
    _, errs = g.emu.run("gin_host_case", [[]] * 3, [[]] * 3, dict(case=case), skip=[1, 2])
    assert errs[0], "accepted"
    assert re.search(text, errs[0]), errs[0]


def test_log_records_kinds_bytes_and_ports():
    g = Gin(contexts=2)
    x = rows(0, n=3, rb=48)
    out, flags = g.probe(KINDS, x, ctx=1)[1]
    assert flags[0] == 0
    log, pending = g.log()
    assert [r["kind"] for r in log] == [PUT, PUT_STRONG, PUT_WEAK, SIGNAL_STRONG, SIGNAL_WEAK]
    assert [r["bytes"] for r in log] == [48, 48, 48, 0, 0]
    assert {(r["src"], r["dst"], r["context"], r["port"], r["devcomm"]) for r in log} == \
        {(0, 1, 1, 1, 0)}  # context 1 on port 1 (set_context_ports), the FULL devComm
    assert all(r["done"] > 0 for r in log)
    assert pending == 0  # the strong signal settled the first put
    np.testing.assert_array_equal(out, x)
    assert g.log()[0] == []  # read and cleared


def test_warp_call_with_divergent_arguments_is_refused():
    # A cooperative call is one operation: every lane must pass the same arguments.
    with pytest.raises(EmuError, match="lanes of a cooperative call passed different"):
        Gin().probe(DIVERGENT, rows(0, n=2), ranks=[0])
