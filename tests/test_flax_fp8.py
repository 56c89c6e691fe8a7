"""jax_ep.flax.MoE(dispatch_dtype="fp8"): activations quantized to FP8 (1 x 128 blocks)
before dispatch and dequantized into the expert matmuls; the gradient with respect to x
is the combine of the received rows' cotangent in the layer's dtype (straight-through)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import ep_mesh, ep_mesh_2d
from jax_ep import flax as ep_flax

H, F, E, K = 128, 64, 8, 2


def _layer(dispatch_dtype, backend="ffi"):
    return ep_flax.MoE(H, F, E, K, backend=backend, capacity_factor=None,
                       dispatch_dtype=dispatch_dtype, rngs=nnx.Rngs(0))


def _x(seed=0, n=64):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n // 8, 8, H)),
                       jnp.float32)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_fp8_layer_close_to_full_precision(backend):
    mesh = ep_mesh_2d(2, 4)
    x = _x()
    with jax.set_mesh(mesh):
        y32, _ = nnx.jit(lambda m, x: m(x))(_layer(None, backend), x)
        y8, aux = nnx.jit(lambda m, x: m(x))(_layer("fp8", backend), x)
    y32, y8 = np.asarray(y32), np.asarray(y8)
    assert y8.shape == x.shape and y8.dtype == np.float32
    err = np.abs(y8 - y32).max() / np.abs(y32).max()
    assert 0 < err < 0.08, err  # FP8 (3 mantissa bits) was used, and only that
    assert int(aux["dropped"]) == 0


def test_fp8_layer_backends_agree_bit_for_bit():
    mesh = ep_mesh_2d(2, 4)
    x = _x(1)
    with jax.set_mesh(mesh):
        a, _ = nnx.jit(lambda m, x: m(x))(_layer("fp8", "ffi"), x)
        b, _ = nnx.jit(lambda m, x: m(x))(_layer("fp8", "reference"), x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_fp8_dispatch_gradient_is_straight_through(backend):
    """d/dx of sum(rows * c) is combine(c), exactly as without FP8; the topk weights'
    gradient is unchanged too."""
    R, T = 4, 6
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((R * R * T, H)), jnp.bfloat16)
    mesh = ep_mesh(R)

    def loss(fp8_path):
        def body(x, idx, w, c):
            if fp8_path:
                rows, _, rw, _ = ep_flax._dispatch_fp8(x, idx, w, num_experts=E,
                                                       axis_name="ep", backend=backend)
            else:
                rows, _, rw, _ = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                                 backend=backend)
            assert rows.dtype == x.dtype
            v = jnp.sum(rows.astype(jnp.float32) * c.astype(jnp.float32))
            return (v + jnp.sum(rw * rw))[None]
        f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        return lambda x, w: jnp.sum(f(x, idx, w, c))

    g8 = jax.jit(jax.grad(loss(True), argnums=(0, 1)))(x, w)
    g16 = jax.jit(jax.grad(loss(False), argnums=(0, 1)))(x, w)
    assert g8[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g8[0], np.float32), np.asarray(g16[0], np.float32))
    np.testing.assert_array_equal(np.asarray(g8[1]), np.asarray(g16[1]))
    assert np.abs(np.asarray(g8[0], np.float32)).sum() > 0


def test_fp8_layer_gradients_flow():
    mesh = ep_mesh_2d(2, 4)
    x = _x(3)
    with jax.set_mesh(mesh):
        m8, m32 = _layer("fp8"), _layer(None)

        def loss(m, x):
            y, aux = m(x)
            return jnp.mean(y ** 2) + 0.01 * aux["load_balance_loss"]

        gx8 = jax.jit(jax.grad(lambda x: loss(m8, x)))(x)
        gx32 = jax.jit(jax.grad(lambda x: loss(m32, x)))(x)
        gw8 = nnx.jit(nnx.grad(lambda m: loss(m, x)))(m8)
    gx8, gx32 = np.asarray(gx8), np.asarray(gx32)
    rel = np.abs(gx8 - gx32).max() / np.abs(gx32).max()
    assert rel < 0.1, rel
    assert np.abs(np.asarray(gw8.w_gate[...])).sum() > 0


def test_fp8_layer_bad_arguments():
    with pytest.raises(ValueError, match=r"dispatch_dtype must be None or 'fp8'"):
        ep_flax.MoE(H, F, E, K, dispatch_dtype="int4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"hidden=96 .*multiple of 128"):
        ep_flax.MoE(96, F, E, K, dispatch_dtype="fp8", rngs=nnx.Rngs(0))


def test_train_script_dispatch_dtype_fp8(tmp_path):
    """examples/train_moe.py --dispatch-dtype fp8 trains (tiny run): finite losses, the
    loss falls, and it tracks the default run (same seed, same batches)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    small = ["--batch", "8", "--seq", "32", "--layers", "1", "--hidden", "128", "--heads",
             "2", "--ffn", "32", "--experts", "8", "--top-k", "2", "--eval-every", "100",
             "--ckpt-every", "100", "--no-progress", "--steps", "12"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    losses = {}
    for d in ("default", "fp8"):
        out = tmp_path / d
        r = subprocess.run([sys.executable, os.path.join(root, "examples", "train_moe.py"),
                            *small, "--out", str(out), "--dispatch-dtype", d], env=env,
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        with open(out / "metrics.jsonl") as f:
            losses[d] = [json.loads(line)["loss"] for line in f]
    a, b = np.asarray(losses["default"]), np.asarray(losses["fp8"])
    assert np.all(np.isfinite(b)) and b[-3:].mean() < b[:3].mean()
    assert np.abs(a - b).max() < 0.05 * a.max(), (a, b)
