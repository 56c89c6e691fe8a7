"""jax_ep.flax.MoE(mode="low_latency"): the same outputs and gradients as the normal
mode on the same weights (to float32 summation order), on both backends; errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ep.flax import MoE

AUTO = jax.sharding.AxisType.Auto
H, F, E, K = 32, 16, 8, 2


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:8])


def _layer(mode, backend, **kw):
    extra = dict(max_tokens_per_rank=8) if mode == "low_latency" else {}
    return MoE(H, F, E, K, backend=backend, capacity_factor=None, mode=mode,
               rngs=nnx.Rngs(0), **extra, **kw)


def _run(moe, x, mesh):
    with jax.set_mesh(mesh):
        def loss(m, x):
            y, aux = m(x)
            return jnp.sum(y * jnp.cos(jnp.arange(H, dtype=jnp.float32))), (y, aux)
        (val, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(moe, x)
    return y, aux, grads


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_low_latency_layer_matches_normal_mode(mesh, backend):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6, H)), jnp.float32)
    y_n, aux_n, g_n = _run(_layer("normal", backend), x, mesh)
    y_l, aux_l, g_l = _run(_layer("low_latency", backend), x, mesh)
    np.testing.assert_allclose(np.asarray(y_l), np.asarray(y_n), rtol=1e-5, atol=1e-5)
    assert int(aux_l["dropped"]) == 0 and int(aux_n["dropped"]) == 0
    np.testing.assert_array_equal(aux_l["tokens_per_expert"], aux_n["tokens_per_expert"])
    for name in ("w_gate", "w_up", "w_down", "router"):
        np.testing.assert_allclose(np.asarray(getattr(g_l, name)[...]),
                                   np.asarray(getattr(g_n, name)[...]), rtol=1e-4,
                                   atol=1e-5, err_msg=name)


def test_low_latency_layer_bad_arguments(mesh):
    with pytest.raises(ValueError, match="mode must be 'normal' or 'low_latency'"):
        MoE(H, F, E, K, mode="fast", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="needs max_tokens_per_rank"):
        MoE(H, F, E, K, mode="low_latency", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_tokens_per_rank applies to mode='low_latency'"):
        MoE(H, F, E, K, max_tokens_per_rank=4, rngs=nnx.Rngs(0))
    moe = MoE(H, F, E, K, mode="low_latency", max_tokens_per_rank=2, backend="reference",
              rngs=nnx.Rngs(0))
    x = jnp.zeros((8, 6, H), jnp.float32)  # 6 tokens per shard > M = 2
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"T > M"):
        moe(x)


def test_low_latency_layer_with_fp8_dispatch_is_not_implemented():
    with pytest.raises(NotImplementedError, match=r"mode='low_latency', dispatch_dtype='fp8'"):
        MoE(128, F, E, K, mode="low_latency", max_tokens_per_rank=4, dispatch_dtype="fp8",
            rngs=nnx.Rngs(0))
