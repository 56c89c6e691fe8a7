"""MoE(expert_matmul=...): "ragged_dot" (the GPU choice) has no per-tile loop in the
program exported for CUDA, and agrees with "tiles" on CPU, forward and backward."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ep import experts
from jax_ep.flax import MoE

AUTO = jax.sharding.AxisType.Auto
EP_TARGETS = ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather", "jax_ep_layout")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:8])


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _fwd_bwd(mesh, expert_matmul, backend="ffi", cf=1.0):
    """(state, x, f) with f(state, x) -> (y, aux, grads wrt state and x) of sum(sin(y))."""
    with jax.set_mesh(mesh):
        moe = MoE(16, 24, 8, 3, backend=backend, capacity_factor=cf,
                  expert_matmul=expert_matmul, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(moe)

    def f(st, x):
        def loss(st, x):
            y, aux = nnx.merge(graphdef, st)(x)
            return jnp.sum(jnp.sin(y)) + 0.1 * aux["load_balance_loss"], (y, aux)

        (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            st, x)
        return y, aux, grads

    return state, _x((4, 16, 16), seed=21), f


def _cuda_ops(expert_matmul):
    # One EP group (data axis 1): on a CPU host the ffi backend adds a host-callback id
    # check across several groups, which has no CUDA lowering.
    mesh = jax.make_mesh((1, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:4])
    state, x, f = _fwd_bwd(mesh, expert_matmul)
    with jax.set_mesh(mesh):
        exp = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t)
                             for t in EP_TARGETS])(state, x)
    assert exp.platforms == ("cuda",)
    return re.findall(r"\b((?:stablehlo|chlo)\.[a-z_]+)", exp.mlir_module())


def test_ragged_dot_exported_for_cuda_has_no_tile_loop():
    """The layer's forward and backward exported for CUDA: with "ragged_dot" no
    `while`/`case`/`if` anywhere (so no predicate read back per tile) and ragged dots do
    the expert matmuls; "tiles" has its loops (what the check would catch)."""
    ragged = _cuda_ops("ragged_dot")
    assert "chlo.ragged_dot" in ragged
    for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
        assert op not in ragged, op
    tiles = _cuda_ops("tiles")  # its chunk loops run while rows are left: data-dependent
    assert "stablehlo.while" in tiles
    assert "chlo.ragged_dot" not in tiles


@pytest.mark.parametrize("backend,cf", [("ffi", 1.0), ("reference", None)])
def test_ragged_dot_matches_tiles_forward_and_backward(mesh, backend, cf):
    out = {}
    for m in ("tiles", "ragged_dot"):
        state, x, f = _fwd_bwd(mesh, m, backend=backend, cf=cf)
        with jax.set_mesh(mesh):
            out[m] = jax.device_get(jax.jit(f)(state, x))
    (ya, auxa, ga), (yb, auxb, gb) = out["tiles"], out["ragged_dot"]
    if cf is not None:
        assert int(auxa["dropped_at_experts"]) > 0  # the comparison covers drops
    for k in auxa:
        np.testing.assert_array_equal(auxa[k], auxb[k], err_msg=k)
    np.testing.assert_allclose(ya, yb, rtol=1e-5, atol=1e-6)
    la, lb = jax.tree.leaves(ga), jax.tree.leaves(gb)
    assert len(la) == len(lb) > 4
    for u, v in zip(la, lb):
        assert float(np.abs(u).max()) > 0
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)


def test_packed_pairs_layout():
    """Expert after expert, no gaps, the tail empty; pairs past cap left out."""
    idx = jnp.asarray([[0, 2], [1, -1], [0, 1], [-1, 2], [0, -1], [-1, -1]], jnp.int32)
    w = jnp.arange(12, dtype=jnp.float32).reshape(6, 2) + 1
    g = experts.group_by_expert(idx, w, 3, 2)
    rows, weights, sizes = experts.packed_pairs(g, 6)
    np.testing.assert_array_equal(sizes, [2, 2, 2])  # expert 0 had 3 pairs, cap 2
    np.testing.assert_array_equal(rows, [0, 2, 1, 2, 0, 3])
    np.testing.assert_array_equal(weights, [1, 5, 3, 6, 2, 8])
    g = experts.group_by_expert(idx, w, 3, 4)
    rows, weights, sizes = experts.packed_pairs(g, 6)
    np.testing.assert_array_equal(sizes, [3, 2, 2])
    np.testing.assert_array_equal(rows, [0, 2, 4, 1, 2, 0, 3] + [6] * 5)
    np.testing.assert_array_equal(weights[7:], 0)


def test_default_by_platform_and_errors():
    assert experts.default_expert_matmul("cpu") == "tiles"
    assert experts.default_expert_matmul("gpu") == "ragged_dot"
    assert experts.check_expert_matmul(None) == experts.default_expert_matmul()
    with pytest.raises(ValueError, match="expert_matmul"):
        MoE(16, 16, 8, 2, expert_matmul="cutlass", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expert_matmul"):
        experts.grouped_swiglu(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32),
                               jnp.zeros((4, 2)), jnp.zeros((2, 8, 4)),
                               jnp.zeros((2, 8, 4)), jnp.zeros((2, 4, 8)), capacity=4,
                               matmul="dense")
