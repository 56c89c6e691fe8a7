"""The CUDA backend's virtual-rank harness (xla_ffi/cuda/cuda_handlers.cc: R ranks on one
GPU, each rank's kernels on a stream of its own) on the emulated GPU, whose streams share
its hardware queues (docs/emulator.md, "Streams and hardware queues"): dispatch, combine
and gather bit for bit against the reference backend; the refusals (more ranks than
CUDA_DEVICE_MAX_CONNECTIONS, concurrent=False); and what ranks that share a queue do,
the deadlock the harness's checks keep out. This is scripts/gpu_check.sh's stages 2 and 6
(the harness) on the emulated GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jax_ep
from jax_ep._src.emu import Emulator

from emu_intranode_util import DISPATCH_KEYS, assert_same, reference, routing, rows

pytestmark = pytest.mark.emu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _case(R, T, H, K, E, C, dtype, kind, seed):
    rng = np.random.default_rng(seed)
    idx = routing(kind, R, T, K, E, rng)
    x = rows(dtype, (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rows(dtype, (R, C, H), rng)
    g = rows(dtype, (R, T, H), rng)
    return x, idx, w, y, g


def _run(emu, x, idx, w, y, g, *, E, C):
    d = emu.harness_dispatch(x, idx, w, num_experts=E, capacity=C)
    d["out"] = emu.harness_combine(y, d["send_row"])
    d["gather"] = emu.harness_gather(g, d["src_rank"], d["src_index"])
    return d


@pytest.fixture(autouse=True)
def _keep_hardware_queues():
    """Each test's hardware_queues setting is its own."""
    with jax_ep.config.override(hardware_queues=jax_ep.config.hardware_queues):
        yield


def _queues(monkeypatch, env: int | None, emulated: int):
    """The count the harness reads (jax_ep.config.hardware_queues, from
    CUDA_DEVICE_MAX_CONNECTIONS; None: unset, the driver's 8) and the queues the emulated
    GPU has, set apart (they differ only where a test says so)."""
    del monkeypatch
    jax_ep.config.update("hardware_queues", 8 if env is None else env)
    return emulated


@pytest.mark.parametrize("R,T,H,K,E,C,dtype,kind,seed", [
    (2, 12, 32, 2, 4, 24, "f32", "random", 1),
    (4, 9, 40, 3, 8, 20, "bf16", "skewed", 2),   # capacity below what arrives: drops
    (8, 6, 24, 2, 16, 48, "f16", "random", 3),   # as many ranks as the default 8 queues
])
def test_harness_matches_reference(monkeypatch, R, T, H, K, E, C, dtype, kind, seed):
    emu = Emulator(1, seed=seed, connections=_queues(monkeypatch, None, 8))
    x, idx, w, y, g = _case(R, T, H, K, E, C, dtype, kind, seed)
    got = _run(emu, x, idx, w, y, g, E=E, C=C)
    want = reference(x, idx, w, y, g, E=E, C=C)
    assert_same(got, want, DISPATCH_KEYS + ("out", "gather"), f"R={R} seed {seed}: ")
    assert emu.check_errors() == []


def test_harness_is_stable_across_calls(monkeypatch):
    """Epochs advance in the shared buffers; a second round gives the same bits."""
    R, T, H, K, E, C = 4, 8, 16, 2, 8, 32
    emu = Emulator(1, seed=5, connections=_queues(monkeypatch, None, 8))
    x, idx, w, y, g = _case(R, T, H, K, E, C, "bf16", "random", 5)
    first = _run(emu, x, idx, w, y, g, E=E, C=C)
    again = _run(emu, x, idx, w, y, g, E=E, C=C)
    assert_same(again, first, DISPATCH_KEYS + ("out", "gather"), "second round: ")
    assert emu.check_errors() == []


def test_more_ranks_than_queues_is_refused(monkeypatch):
    """16 ranks on 8 queues would put ranks r and r + 8 on one queue: refused on the host,
    naming the variable that raises the count."""
    R, T, H, K, E, C = 16, 2, 8, 1, 16, 8
    emu = Emulator(1, seed=1, connections=_queues(monkeypatch, None, 8))
    x, idx, w, _, _ = _case(R, T, H, K, E, C, "f32", "random", 1)
    with pytest.raises(ValueError, match=r"R = 16 .*CUDA_DEVICE_MAX_CONNECTIONS = 8 .*at least 16"):
        emu.harness_dispatch(x, idx, w, num_experts=E, capacity=C)
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS must be an integer in"):
        jax_ep.config.from_env({"CUDA_DEVICE_MAX_CONNECTIONS": "many"})
    with pytest.raises(ValueError, match="hardware_queues must be an integer in"):
        jax_ep.config.update("hardware_queues", 33)


def test_serialised_mode_is_refused(monkeypatch):
    R, T, H, K, E, C = 2, 4, 8, 1, 4, 8
    emu = Emulator(1, seed=1, connections=_queues(monkeypatch, None, 8))
    x, idx, w, y, _ = _case(R, T, H, K, E, C, "f32", "random", 1)
    with pytest.raises(ValueError, match="concurrent=False .*cannot run"):
        emu.harness_dispatch(x, idx, w, num_experts=E, capacity=C, concurrent=False)
    send_row = np.full((R, T, R), -1, np.int32)
    with pytest.raises(ValueError, match="concurrent=False"):
        emu.harness_combine(y, send_row, concurrent=False)


def _sixteen_ranks_script(env: int, emulated: int) -> str:
    """A child process (32 CPU devices for the reference of 16 ranks): the harness's 16
    ranks with CUDA_DEVICE_MAX_CONNECTIONS = env for the harness and `emulated` queues on
    the emulated GPU; prints MATCH, MISMATCH or ERROR and the device errors."""
    return f"""
import os, sys
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "{env}"
sys.path.insert(0, {HERE!r})
import numpy as np
from jax_ep._src.emu import Emulator
from emu_intranode_util import DISPATCH_KEYS, assert_same, reference, routing, rows
R, T, H, K, E, C = 16, 3, 8, 2, 32, 12
rng = np.random.default_rng(16)
idx = routing("random", R, T, K, E, rng)
x = rows("f32", (R, T, H), rng)
w = rng.standard_normal((R, T, K)).astype(np.float32)
y = rows("f32", (R, C, H), rng)
emu = Emulator(1, seed=16, connections={emulated}, timeout_s=0.01)
try:
    d = emu.harness_dispatch(x, idx, w, num_experts=E, capacity=C)
    d["out"] = emu.harness_combine(y, d["send_row"])
    want = reference(x, idx, w, y, np.zeros_like(x), E=E, C=C)
    assert_same(d, want, DISPATCH_KEYS + ("out",))
    print("MATCH")
except AssertionError as e:
    print("MISMATCH", str(e)[:200])
except Exception as e:
    print("ERROR", type(e).__name__, str(e)[:300])
errs = emu.check_errors()
print("DEVICE_ERRORS", len(errs), *[e[:160] for e in errs])
"""


def _sixteen_ranks(env: int, emulated: int) -> str:
    env_vars = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=32")
    p = subprocess.run([sys.executable, "-c", _sixteen_ranks_script(env, emulated)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env=env_vars)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_sixteen_ranks_on_32_queues_match_reference():
    """CUDA_DEVICE_MAX_CONNECTIONS=32 (as the tests and gpu_check.sh set it): 16 ranks,
    each on a queue of its own."""
    out = _sixteen_ranks(32, 32)
    assert "MATCH" in out.split() and "DEVICE_ERRORS 0" in out, out


def test_sixteen_ranks_sharing_8_queues_time_out():
    """Today's harness on a GPU of 8 queues: the harness is told 32 (the check passes, as
    the old harness had none), the GPU has 8, so ranks r and r + 8 share a queue: r + 8's
    kernels wait behind r's, which wait for them, until the kernels' timeout. The rule the
    harness's check exists for; a test of the emulator's queues as much as of the harness."""
    out = _sixteen_ranks(32, 8)
    assert "MATCH" not in out.split(), out
    assert "DEVICE_ERRORS 0" not in out and "timed out in dispatch waiting for rank" in out, out


def test_queue_of_a_stream_is_its_creation_order(monkeypatch):
    """Each emulator numbers its GPUs' streams alike: the default stream, the call stream,
    then the harness's; what the join-order test below relies on."""
    emu = Emulator(1, seed=2, connections=_queues(monkeypatch, None, 8))
    assert emu.connections == 8
    before = emu.m.num_streams()
    R, T, H, K, E, C = 3, 4, 8, 1, 6, 12
    x, idx, w, _, _ = _case(R, T, H, K, E, C, "f32", "random", 2)
    emu.harness_dispatch(x, idx, w, num_experts=E, capacity=C)
    assert emu.m.num_streams() == before + R  # exactly R rank streams, not 32
    emu.harness_dispatch(x[:2], idx[:2] % 4, w[:2], num_experts=4, capacity=C)
    assert emu.m.num_streams() == before + R  # fewer ranks reuse them


def test_ranks_sharing_a_queue_with_xla_stream_finish(monkeypatch):
    """R = 8 rank streams and the call's own stream on 8 queues: the call stream shares a
    queue with rank 7 (streams 1 and 9). Its waits for the ranks must come after every
    rank's launches, else the wait for rank 0 holds back rank 7's kernels, which rank 0's
    wait for."""
    R, T, H, K, E, C = 8, 4, 16, 2, 16, 32
    emu = Emulator(1, seed=8, connections=_queues(monkeypatch, None, 8))
    x, idx, w, y, g = _case(R, T, H, K, E, C, "f32", "random", 8)
    got = _run(emu, x, idx, w, y, g, E=E, C=C)
    want = reference(x, idx, w, y, g, E=E, C=C)
    assert_same(got, want, DISPATCH_KEYS + ("out", "gather"), "R=8 on 8 queues: ")
    assert emu.check_errors() == []


def test_emulator_connections_are_checked():
    with pytest.raises(ValueError, match="connections"):
        Emulator(1, connections=0)
    with pytest.raises(ValueError, match="connections"):
        Emulator(1, connections=33)


@pytest.mark.parametrize("R,M,H,K,E,dtype,seed", [(4, 4, 16, 2, 8, "bf16", 21),
                                                  (8, 3, 8, 3, 16, "f32", 22)])
def test_low_latency_harness_matches_reference(monkeypatch, R, M, H, K, E, dtype, seed):
    """The low-latency harness (xla_ffi/cuda/low_latency_handlers.cc): every rank's send
    half, then every rank's receive half, on the call's one stream (no rank waits for a
    kernel behind it there), bit for bit against the reference backend."""
    from emu_intranode_util import LL_DISPATCH_KEYS, bits, ll_reference, ll_routing
    emu = Emulator(1, seed=seed, connections=_queues(monkeypatch, None, 8))
    rng = np.random.default_rng(seed)
    idx = ll_routing(R, M, K, E, rng)
    x = rows(dtype, (R, M, H), rng)
    w = rng.standard_normal((R, M, K)).astype(np.float32)
    y = rows(dtype, (R, E // R, R * M, H), rng)
    d = emu.ll_harness_dispatch(x, idx, num_experts=E, max_tokens=M)
    d["out"] = emu.ll_harness_combine(y, idx, w, d["first_row"], d["row_count"],
                                      num_experts=E, max_tokens=M)
    want = ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=M * min(K, E // R))
    assert_same(d, want, [k for k in LL_DISPATCH_KEYS if k != "recv_x"] + ["out"],
                f"seed {seed}: ")
    for r in range(R):  # rows past recv_count are unspecified on a GPU
        for e in range(E // R):
            c = int(want["recv_count"][r, e])
            assert np.array_equal(bits(d["recv_x"][r, e, :c]), bits(want["recv_x"][r, e, :c])), \
                (r, e)
    assert emu.check_errors() == []
