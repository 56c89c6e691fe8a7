"""The MoE layer's default receive capacity: from the experts' places when
capacity_factor is set (never above R * T), R * T when it is None."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ep.flax import MoE, receive_capacity
from test_flax import _np_moe

AUTO = jax.sharding.AxisType.Auto


def _places(T, R, E, K, cf):
    """E_local * cap, cap = ceil(cf * T * K / E_local) rounded up to a multiple of 8."""
    el = E // R
    return el * 8 * math.ceil(math.ceil(cf * T * K / el) / 8)


@pytest.mark.parametrize("R", [8, 64])
def test_receive_capacity_sizes(R):
    """DeepSeek-V3-like sizes (E 256, top-8) at R 8 and 64, computed, no devices: at R 8
    the experts' places (16 T at cf 2) exceed R * T, so the worst case stays; at R 64
    they are a quarter of it."""
    E, K = 256, 8
    for T in (4096, 65536):
        assert receive_capacity(T, R, E, K, None) == R * T
        for cf in (2.0, 1.25, 0.5):
            want = min(R * T, _places(T, R, E, K, cf))
            assert receive_capacity(T, R, E, K, cf) == want
        if R == 8:
            assert receive_capacity(T, R, E, K, 2.0) == 8 * T
            assert receive_capacity(T, R, E, K, 0.5) == 4 * T
        else:
            assert receive_capacity(T, R, E, K, 2.0) == 16 * T
            assert receive_capacity(T, R, E, K, 1.25) == 10 * T
    # The layer asks for it (None when it is the worst case, which dispatch defaults to).
    moe = MoE(8, 8, E, K, capacity_factor=2.0, rngs=nnx.Rngs(0))
    got = moe._capacity(4096, R)
    assert got == (None if R == 8 else 16 * 4096)
    assert MoE(8, 8, E, K, capacity_factor=None, rngs=nnx.Rngs(0))._capacity(4096, R) is None
    assert MoE(8, 8, E, K, capacity=1000, rngs=nnx.Rngs(0))._capacity(4096, R) == 1000


def test_receive_capacity_errors():
    with pytest.raises(ValueError, match="num_experts"):
        receive_capacity(16, 3, 8, 2, 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        receive_capacity(16, 4, 8, 2, 0.0)


def _skewed(E=8, N=128, seed=0):
    """x[N, E] whose top-2 under a router of 20*I: 5 tokens in 8 pick experts (0, 1)
    (EP rank 0 of 4), the rest two distinct random experts."""
    rng = np.random.default_rng(seed)
    x = np.zeros((N, E), np.float32)
    for t in range(N):
        e1, e2 = (0, 1) if rng.random() < 5 / 8 else rng.choice(E, 2, replace=False)
        x[t, e1], x[t, e2] = 1.0, 0.5
    return jnp.asarray(x)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_skewed_routing_drops_match_numpy(backend):
    """8 CPU devices, EP groups of R = 4 ranks, T = 16 tokens a rank, cf 1.0: each rank
    receives at most E_local * cap = 2 * 16 = 32 of the 64 worst-case rows. The rows
    and slots dropped match a NumPy model of both stages; against the worst-case receive
    capacity, only rows that could not all have been computed are lost."""
    E, K, R, T, cf = 8, 2, 4, 16, 1.0
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:8])
    x = _skewed(E)
    res = {}
    for name, capacity in (("default", None), ("worst case", R * T)):
        with jax.set_mesh(mesh):
            moe = MoE(E, 16, E, K, backend=backend, capacity=capacity,
                      capacity_factor=cf, rngs=nnx.Rngs(2))
            moe.router[...] = 20 * jnp.eye(E)
            y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
        res[name] = (np.asarray(y), jax.device_get(aux))
    recv = receive_capacity(T, R, E, K, cf)
    assert recv == 32
    cap = 16
    idx = np.asarray(jax.lax.top_k(20 * x, K)[1])
    p = np.exp(20 * np.asarray(x, np.float64))
    w = np.take_along_axis(p, idx, 1)
    w /= w.sum(1, keepdims=True)
    for name, r in (("default", recv), ("worst case", None)):
        want, dropped, rows, at_experts = _np_moe(moe, x, idx, w, group_tokens=R * T,
                                                  cap=cap, recv=r, el=E // R)
        y, aux = res[name]
        np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-5)
        assert int(aux["dropped"]) == dropped
        assert int(aux["dropped_rows"]) == rows
        assert int(aux["dropped_at_experts"]) == at_experts
    d, wc = res["default"][1], res["worst case"][1]
    assert int(d["dropped_rows"]) > 0 and int(wc["dropped_rows"]) == 0
    assert int(wc["dropped_at_experts"]) > 0
    assert int(d["dropped"]) >= int(wc["dropped"])
