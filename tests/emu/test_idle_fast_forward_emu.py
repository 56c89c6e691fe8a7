"""The emulator's idle fast-forward (Emulator(idle_after_ns=...), docs/emulator.md): once
every thread has only polled and slept for a while, sleeps lengthen, so a kernel waiting
for a rank that never comes reaches its own timeout in a few hundred wake-ups. A run that
is never idle that long must be exactly the run it was without it: the same steps, the
same virtual time, the same bits."""
from __future__ import annotations

import numpy as np
import pytest

from jax_ep._src.emu import Emulator

from emu_intranode_util import routing, rows

pytestmark = pytest.mark.emu

T, H, K, E = 8, 16, 2, 8


def _case(R, seed):
    rng = np.random.default_rng(seed)
    idx = routing("random", R, T, K, E, rng)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    return x, idx, w


def _skipped_call(idle_after_ns, timeout_s):
    R = 2
    emu = Emulator(R, seed=21, timeout_s=timeout_s, idle_after_ns=idle_after_ns)
    emu.setup(tokens=T, capacity=2 * T, row_bytes=H * 2, topk=K)
    x, idx, w = _case(R, 21)
    emu.reset_counters()
    emu.dispatch(x, idx, w, num_experts=E, capacity=2 * T, skip=[1])  # rank 1 never comes
    return emu.check_errors(), emu.counters()


def test_a_rank_that_never_comes_times_out_in_few_steps_through_the_kernels_timeout():
    timeout_s = 0.01
    fast_errs, fast = _skipped_call(250e3, timeout_s)
    slow_errs, slow = _skipped_call(0, timeout_s)
    # The same error, from the kernels' own timeout path, both ways.
    assert fast_errs == slow_errs and any("timed out" in e for e in fast_errs), (fast_errs,
                                                                                 slow_errs)
    assert fast.get("idle_sleeps", 0) > 0 and "idle_sleeps" not in slow, (fast, slow)
    # The waiting threads' wake-ups (a sleep, then a poll, each): about timeout /
    # min_sleep_ns of them without the fast-forward, a few hundred with it.
    assert fast["sleeps"] * 20 < slow["sleeps"], (fast["sleeps"], slow["sleeps"])
    assert fast["steps"] < slow["steps"], (fast["steps"], slow["steps"])
    # The virtual wait is the timeout either way; a waiter sees the clock pass it at most
    # one lengthened sleep (timeout / 50) later.
    t = timeout_s * 1e9
    assert slow["virtual_ns"] > t and fast["virtual_ns"] > t, (fast, slow)
    assert fast["virtual_ns"] < slow["virtual_ns"] + 2 * t / 50, (fast["virtual_ns"],
                                                                  slow["virtual_ns"])


@pytest.mark.parametrize("R,seed,preempt", [
    (4, 3, 0.0), (4, 5, 0.002), pytest.param(8, 7, 0.0, marks=pytest.mark.emu_full)])
def test_a_run_never_idle_that_long_is_unchanged(R, seed, preempt):
    """Dispatch, combine and gather with and without the fast-forward: identical outputs
    and identical counters, the scheduler's steps and the virtual clock included."""
    runs = []
    for idle in (250e3, 0):
        emu = Emulator(R, seed=seed, idle_after_ns=idle, preempt_prob=preempt,
                       preempt_ns=20000.0 if preempt else 0.0)
        emu.setup(tokens=T, capacity=2 * T, row_bytes=H * 2, topk=K)
        x, idx, w = _case(R, seed)
        emu.reset_counters()
        d = emu.dispatch(x, idx, w, num_experts=E, capacity=2 * T)
        d["combined"] = emu.combine(d["recv_x"], d["send_row"])
        d["gathered"] = emu.gather(x, d["src_rank"], d["src_index"])
        assert emu.check_errors() == [], f"R={R} seed={seed} idle={idle}"
        runs.append((d, emu.counters()))
    (a, ca), (b, cb) = runs
    assert "idle_sleeps" not in ca, ca.get("idle_sleeps")
    assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb)
                      if ca.get(k) != cb.get(k)}
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def test_idle_after_ns_is_checked():
    with pytest.raises(ValueError, match="idle_after_ns"):
        Emulator(2, idle_after_ns=-1.0)


def _hierarchical_skip(idle_after_ns):
    from internode_emu_util import InternodeEmu
    from test_internode_hier_emu import data
    R, G, T, H, K, E, C = 4, 2, 4, 4, 2, 8, 16
    em = InternodeEmu(R, gpus_per_node=G, timeout_s=0.005, idle_after_ns=idle_after_ns)
    x, idx, w, _, _ = data(np.random.default_rng(1), R, T, H, K, E, C, np.float32)
    em.emu.reset_counters()
    em.dispatch(x, idx, w, num_experts=E, capacity=C, mode="hierarchical", skip=(3,))
    return em.errors(), em.emu.counters()


def test_spinning_waiters_reach_their_timeout_in_few_steps_too():
    """The internode kernels poll without sleeping: in an idle stretch a step takes as long
    as a lengthened sleep, so their timeouts fire after few steps as well."""
    fast_errs, fast = _hierarchical_skip(250e3)
    slow_errs, slow = _hierarchical_skip(0)
    assert fast_errs == slow_errs and all(fast_errs[:3]), (fast_errs, slow_errs)
    # (5 ms: the idle threshold, 250 us of spinning, is a good part of what remains)
    assert fast["steps"] * 3 < slow["steps"], (fast["steps"], slow["steps"])
    assert fast["virtual_ns"] > 5e6 and slow["virtual_ns"] > 5e6, (fast, slow)
