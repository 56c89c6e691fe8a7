"""jax_ep.flax.MoE: backends agree, hand-built routing, training, checkpoints, the example."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ep import experts
from jax_ep.flax import MoE, RoutingBias, receive_capacity, route

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:8])


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _assert_expert_sharded(a):
    spec = tuple(a.sharding.spec)
    assert spec[:1] == ("expert",) and all(s is None for s in spec[1:]), spec


def _np_swiglu(x, wg, wu, wd):
    g = x @ wg
    return ((g / (1 + np.exp(-g))) * (x @ wu)) @ wd


def _np_moe(moe, x, idx, w, group_tokens=None, cap=None, recv=None, el=None):
    """Dense NumPy oracle: y[t] = sum_k w[t,k] * SwiGLU_{idx[t,k]}(x[t]). With `cap`,
    each EP group (`group_tokens` consecutive tokens) keeps only the first `cap` tokens
    naming each expert (in token order, which is the received order); with `recv` too,
    each rank (experts `el` at a time) first keeps only the first `recv` tokens naming
    any of its experts. Returns (y, slots dropped, rows dropped at receive, slots
    dropped at the experts) then."""
    x = np.asarray(x, np.float64).reshape(-1, moe.hidden)
    idx, w = np.asarray(idx), np.asarray(w)
    wg, wu, wd = (np.asarray(v[...], np.float64) for v in (moe.w_gate, moe.w_up,
                                                          moe.w_down))
    y = np.zeros_like(x)
    seen, rows, dropped, dropped_rows, at_experts = {}, {}, 0, 0, 0
    for t in range(x.shape[0]):
        kept_row = {}
        for e, c in zip(idx[t], w[t]):
            if e < 0:
                continue
            if recv is not None:
                r = (t // group_tokens, int(e) // el)
                if r not in kept_row:
                    rows[r] = rows.get(r, 0) + 1
                    kept_row[r] = rows[r] <= recv
                    dropped_rows += not kept_row[r]
                if not kept_row[r]:
                    dropped += 1
                    continue
            if cap is not None:
                key = (t // group_tokens, int(e))
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > cap:
                    dropped += 1
                    at_experts += 1
                    continue
            y[t] += c * _np_swiglu(x[t], wg[e], wu[e], wd[e])
    return y if cap is None else (y, dropped, dropped_rows, at_experts)


def _loss_and_grads(moe, x):
    def loss(m):
        y, aux = m(x)
        return jnp.sum(jnp.sin(y)) + 0.1 * aux["load_balance_loss"], (y, aux)

    return nnx.jit(lambda m: nnx.value_and_grad(loss, has_aux=True)(m))(moe)


# ----------------------------------------------------------------------------- backends

@pytest.mark.parametrize("cfg", [
    dict(),
    dict(score="sigmoid", n_groups=4, topk_groups=2, routing_bias=True, shared_experts=1,
         capacity=6),
])
def test_ffi_matches_reference(mesh, cfg):
    x = _x((4, 16, 16))
    res, params = {}, {}
    for be in ("reference", "ffi"):
        with jax.set_mesh(mesh):
            moe = MoE(16, 24, 8, 2, backend=be, rngs=nnx.Rngs(7), **cfg)
            params[be] = nnx.state(moe)
            (l, (y, aux)), g = _loss_and_grads(moe, x)
        res[be] = (l, y, aux, nnx.state(g))
        _assert_expert_sharded(moe.w_gate[...])
    # Same seed, same parameters, whatever the backend.
    jax.tree.map(np.testing.assert_array_equal, params["reference"], params["ffi"])
    (la, ya, aa, ga), (lb, yb, ab, gb) = res["reference"], res["ffi"]
    np.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for k in aa:
        np.testing.assert_allclose(aa[k], ab[k], rtol=1e-6)
    if "capacity" in cfg:
        assert int(aa["dropped"]) > 0  # the comparison covers dropped rows too
    flat_a, flat_b = jax.tree.leaves(ga), jax.tree.leaves(gb)
    assert len(flat_a) == len(flat_b) > 0
    for u, v in zip(flat_a, flat_b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(ga["w_gate"][...]).sum()) > 0
    assert float(jnp.abs(ga["router"][...]).sum()) > 0


def test_matches_dense_oracle_and_shardings(mesh):
    """capacity_factor=None never drops: the layer is the dense oracle."""
    x = _x((4, 16, 16), seed=1)
    with jax.set_mesh(mesh):
        moe = MoE(16, 24, 8, 3, capacity_factor=None, rngs=nnx.Rngs(0))
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        y, aux = nnx.jit(lambda m, x: m(x))(moe, xs)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert int(aux["dropped"]) == 0 and int(aux["dropped_rows"]) == 0
    logits = x.reshape(-1, 16) @ moe.router[...]
    idx, w, _ = route(logits, 3)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), _np_moe(moe, x, idx, w),
                               rtol=2e-4, atol=2e-5)
    assert int(aux["tokens_per_expert"].sum()) == 64 * 3


# ----------------------------------------------------------------------------- routing

def _hand_routed(E=8):
    """x[64, E] whose top-2 experts under a router of 20*I are (t % E, (3t + 1) % E)."""
    t = np.arange(64)
    e1, e2 = t % E, (3 * t + 1) % E
    x = np.zeros((64, E), np.float32)
    x[t, e1] = 1.0
    x[t, e2] = 0.5
    return jnp.asarray(x), e1, e2


def _set_router(moe, w):
    moe.router[...] = jnp.asarray(w, jnp.float32)


def test_hand_built_routing_aux(mesh):
    E = 8
    x, e1, e2 = _hand_routed(E)
    with jax.set_mesh(mesh):
        moe = MoE(E, 16, E, 2, rngs=nnx.Rngs(1))
        _set_router(moe, 20 * np.eye(E))
        y, aux = nnx.jit(lambda m, x: m(x))(moe, x.reshape(4, 16, E))
    assert y.shape == (4, 16, E)
    assert aux["tokens_per_expert"].shape == (E,)
    want_counts = np.bincount(np.concatenate([e1, e2]), minlength=E)
    np.testing.assert_array_equal(aux["tokens_per_expert"], want_counts)
    assert int(aux["dropped"]) == 0
    logits = 20 * np.asarray(x, np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_lb = E * np.sum(want_counts / 128 * p.mean(0))
    np.testing.assert_allclose(float(aux["load_balance_loss"]), want_lb, rtol=1e-5)
    w1 = p[np.arange(64), e1] / (p[np.arange(64), e1] + p[np.arange(64), e2])
    idx = np.stack([e1, e2], 1)
    w = np.stack([w1, 1 - w1], 1)
    np.testing.assert_allclose(np.asarray(y).reshape(64, E), _np_moe(moe, x, idx, w),
                               rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_capacity_drops(mesh, backend):
    """Every token picks experts 0 and 1 (EP rank 0): rank 0 of each of the 2 EP groups
    receives 4 * T rows and keeps the first T (source rank 0's tokens)."""
    E, T = 8, 8
    x = np.zeros((64, E), np.float32)
    x[:, 0], x[:, 1] = 1.0, 0.5
    with jax.set_mesh(mesh):
        moe = MoE(E, 16, E, 2, backend=backend, capacity=T, rngs=nnx.Rngs(2))
        _set_router(moe, 20 * np.eye(E))
        y, aux = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    assert int(aux["dropped_rows"]) == 2 * 3 * T
    assert int(aux["dropped"]) == 2 * 3 * T * 2  # each dropped row held 2 slots
    np.testing.assert_array_equal(aux["tokens_per_expert"], [64, 64, 0, 0, 0, 0, 0, 0])
    kept = (np.arange(64) // T) % 4 == 0  # token shards are (data, expert) major-to-minor
    y = np.asarray(y)
    assert np.all(y[~kept] == 0)
    assert np.all(np.abs(y[kept]).sum(1) > 0)


@pytest.mark.parametrize("cf", [0.5, 2.0])
def test_expert_capacity_drops_match_numpy(mesh, cf):
    """Per-expert capacity: each expert keeps its first `cap` pairs in received order
    (source rank, then token); the rest are dropped and counted as slots. The default
    receive capacity is the rank's places, `E_local * cap` rows (16 of 32 at cf=0.5)."""
    x = _x((4, 16, 16), seed=11)
    with jax.set_mesh(mesh):
        moe = MoE(16, 24, 8, 3, capacity_factor=cf, rngs=nnx.Rngs(3))
        y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    R, T, K, el = 4, 8, 3, 2
    cap = experts.expert_capacity(T * K, el, cf, limit=R * T)
    recv = receive_capacity(T, R, 8, K, cf)
    assert recv == min(R * T, el * cap)
    idx, w, _ = route(x.reshape(-1, 16) @ moe.router[...], K)
    want, dropped, rows, at_experts = _np_moe(moe, x, idx, w, group_tokens=R * T,
                                              cap=cap, recv=recv, el=el)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want, rtol=2e-4, atol=2e-5)
    assert int(aux["dropped"]) == dropped
    assert int(aux["dropped_rows"]) == rows
    assert int(aux["dropped_at_experts"]) == at_experts
    if cf < 1:
        assert rows > 0 and at_experts > 0  # the case covers both kinds of drops
    if cf >= 2:
        assert dropped == 0


def test_capacity_factor_argument_errors():
    for bad in (0, -1.5):
        with pytest.raises(ValueError, match="capacity_factor"):
            MoE(16, 16, 8, 2, capacity_factor=bad, rngs=nnx.Rngs(0))
    for bad in ("2", True):
        with pytest.raises(TypeError, match="capacity_factor"):
            MoE(16, 16, 8, 2, capacity_factor=bad, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cf", [None, 1.0])
def test_layer_gradients_numerically(mesh, cf):
    """Directional finite differences of a scalar loss against the layer's gradient
    (every parameter and x at once), in float32 on small shapes."""
    x = _x((2, 16, 8), seed=12)
    with jax.set_mesh(mesh):
        moe = MoE(8, 8, 8, 2, capacity_factor=cf, rngs=nnx.Rngs(4))
        graphdef, params = nnx.split(moe)

        def loss(p, x):
            y, aux = nnx.merge(graphdef, p)(x)
            return jnp.sum(jnp.sin(y)) + 0.1 * aux["load_balance_loss"]

        f = jax.jit(loss)
        gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
        rng = np.random.default_rng(5)
        vp = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                          params)
        vx = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        eps = 1e-3
        plus = f(jax.tree.map(lambda a, v: a + eps * v, params, vp), x + eps * vx)
        minus = f(jax.tree.map(lambda a, v: a - eps * v, params, vp), x - eps * vx)
        numeric = (float(plus) - float(minus)) / (2 * eps)
        analytic = float(sum(jnp.vdot(g, v) for g, v in
                             zip(jax.tree.leaves(gp), jax.tree.leaves(vp)))
                         + jnp.vdot(gx, vx))
        _, aux = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
    if cf is not None:
        assert int(aux["dropped"]) > 0  # the gradient check covers dropped slots
    assert abs(analytic) > 1e-2
    np.testing.assert_allclose(numeric, analytic, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("backend,matmul", [("ffi", "tiles"), ("reference", "tiles"),
                                            ("ffi", "ragged_dot")])
def test_parameter_gradients_with_and_without_x(mesh, backend, matmul):
    """A gradient over the parameters alone (x the data: the layer then skips the rows'
    cotangent) equals the parameters' part of the gradient over (parameters, x), under
    jit(grad) and grad(jit) (which traces the layer before it knows what is
    differentiated), and matches finite differences; x computed from a parameter still
    gets its cotangent."""
    x = _x((2, 16, 8), seed=21)
    with jax.set_mesh(mesh):
        moe = MoE(8, 8, 8, 2, capacity_factor=1.0, backend=backend, expert_matmul=matmul,
                  rngs=nnx.Rngs(6))
        graphdef, params = nnx.split(moe)

        def loss(p, x):
            y, aux = nnx.merge(graphdef, p)(x)
            return jnp.sum(jnp.sin(y)) + 0.1 * aux["load_balance_loss"]

        only_p = jax.jit(jax.grad(loss))(params, x)
        only_p_outer = jax.grad(jax.jit(loss))(params, x)
        both, _ = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
        for a, b, c in zip(jax.tree.leaves(only_p), jax.tree.leaves(only_p_outer),
                           jax.tree.leaves(both)):
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(jax.tree.leaves(only_p)[0]).sum()) > 0

        rng = np.random.default_rng(7)
        vp = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                          params)
        eps = 1e-3
        f = jax.jit(loss)
        numeric = (float(f(jax.tree.map(lambda a, v: a + eps * v, params, vp), x))
                   - float(f(jax.tree.map(lambda a, v: a - eps * v, params, vp), x))) / (
            2 * eps)
        analytic = float(sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(only_p),
                                                            jax.tree.leaves(vp))))
        np.testing.assert_allclose(numeric, analytic, rtol=2e-2, atol=2e-3)

        # x made from a parameter (as every layer after the first): its cotangent flows.
        def loss_scaled(p, s):
            return loss(p, x * s)

        gs = jax.jit(jax.grad(loss_scaled, argnums=1))(params, jnp.float32(1.0))
        _, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
        np.testing.assert_allclose(gs, jnp.vdot(gx, x), rtol=1e-4)


def test_parameter_gradient_skips_the_rows_cotangent(mesh):
    """The gradient over the parameters alone has fewer matmuls than the one over
    (parameters, x): the experts' `dgu @ [gate | up]^T` per chunk size is gone."""
    import re

    x = _x((2, 64, 16), seed=22)
    with jax.set_mesh(mesh):
        moe = MoE(16, 16, 8, 2, rngs=nnx.Rngs(8))
        graphdef, params = nnx.split(moe)

        def loss(p, x):
            return jnp.mean(nnx.merge(graphdef, p)(x)[0] ** 2)

        def dots(f):
            return len(re.findall(r" dot\(", f.lower(params, x).compile().as_text()))

        only_p = dots(jax.jit(jax.grad(loss)))
        both = dots(jax.jit(jax.grad(loss, argnums=(0, 1))))
    assert only_p < both, (only_p, both)


def test_group_limited_routing_and_bias():
    logits = _x((32, 8), seed=3)
    idx, w, probs = route(logits, 2, n_groups=4, topk_groups=1)
    assert np.all(np.asarray(idx[:, 0]) // 2 == np.asarray(idx[:, 1]) // 2)
    idx3, _, _ = route(logits, 3, score="sigmoid", n_groups=4, topk_groups=2)
    assert all(len(set((np.asarray(r) // 2).tolist())) <= 2 for r in idx3)
    np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs).sum(1), 1.0, rtol=1e-6)
    # A large bias on expert 5 makes everyone pick it; the weights ignore the bias.
    bias = jnp.zeros(8).at[5].set(100.0)
    bidx, bw, _ = route(logits, 2, score="sigmoid", bias=bias)
    assert np.all(np.asarray(bidx) == 5, axis=1).sum() == 0
    assert np.all(np.any(np.asarray(bidx) == 5, axis=1))
    s = jax.nn.sigmoid(logits)
    sel = jnp.take_along_axis(s, bidx, 1)
    np.testing.assert_allclose(bw, sel / sel.sum(1, keepdims=True), rtol=1e-6)


def test_routing_bias_update_and_optimizer_excludes_it(mesh):
    with jax.set_mesh(mesh):
        moe = MoE(16, 16, 8, 2, routing_bias=True, rngs=nnx.Rngs(0))
    assert isinstance(moe.routing_bias, RoutingBias)
    moe.update_routing_bias(jnp.array([10, 0, 5, 5, 5, 5, 5, 5]), rate=0.5)
    np.testing.assert_allclose(moe.routing_bias[...], [-0.5, 0.5, 0, 0, 0, 0, 0, 0])
    opt = nnx.Optimizer(moe, optax.sgd(0.1), wrt=nnx.Param)
    assert not any(isinstance(v, RoutingBias) for v in
                   jax.tree.leaves(nnx.state(opt), is_leaf=lambda v: isinstance(v,
                                                                                  nnx.Variable)))


def test_no_mesh_single_rank():
    x = _x((2, 8, 16), seed=4)
    moe = MoE(16, 16, 4, 2, rngs=nnx.Rngs(0))
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    idx, w, _ = route(x.reshape(-1, 16) @ moe.router[...], 2)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), _np_moe(moe, x, idx, w),
                               rtol=2e-4, atol=2e-5)


def test_explicit_mesh_bf16(mesh):
    x = _x((4, 16, 16), seed=5)
    outs = {}
    for kind in (AUTO, jax.sharding.AxisType.Explicit):
        m = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind, kind),
                          devices=jax.devices()[:8])
        with jax.set_mesh(m):
            moe = MoE(16, 16, 8, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            xs = jax.device_put(x, jax.sharding.NamedSharding(m, P("data")))
            y, _ = nnx.jit(lambda m, x: m(x))(moe, xs)
            g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))(moe, xs)
        outs[kind] = (np.asarray(y), np.asarray(g.w_up[...]))
    a, b = outs.values()
    np.testing.assert_allclose(a[0], b[0], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(a[1], b[1], rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- training

def test_optimizer_steps_lower_loss(mesh):
    x = _x((4, 16, 16), seed=6)
    target = jnp.tanh(x[..., ::-1] * 2)
    with jax.set_mesh(mesh):
        moe = MoE(16, 32, 8, 2, routing_bias=True, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(moe, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(m, opt):
            def loss(m):
                y, aux = m(x)
                return jnp.mean((y - target) ** 2) + 1e-2 * aux["load_balance_loss"], aux

            (l, aux), g = nnx.value_and_grad(loss, has_aux=True)(m)
            opt.update(m, g)
            m.update_routing_bias(aux["tokens_per_expert"])
            return l

        losses = [float(step(moe, opt)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert float(jnp.abs(moe.routing_bias[...]).sum()) > 0


def test_checkpoint_roundtrip(mesh, tmp_path):
    import orbax.checkpoint as ocp

    x = _x((4, 16, 16), seed=8)
    with jax.set_mesh(mesh):
        a = MoE(16, 16, 8, 2, routing_bias=True, shared_experts=1, rngs=nnx.Rngs(0))
        a.update_routing_bias(jnp.arange(8), rate=0.1)
        ya, _ = nnx.jit(lambda m, x: m(x))(a, x)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "moe", nnx.to_pure_dict(nnx.state(a)))
        b = MoE(16, 16, 8, 2, routing_bias=True, shared_experts=1, rngs=nnx.Rngs(1))
        state = nnx.state(b)
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                             sharding=v.sharding),
                              nnx.to_pure_dict(state))
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(tmp_path / "moe", target)
        nnx.replace_by_pure_dict(state, restored)
        nnx.update(b, state)
        yb, _ = nnx.jit(lambda m, x: m(x))(b, x)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))
    _assert_expert_sharded(b.w_gate[...])
    np.testing.assert_array_equal(ya, yb)


# ----------------------------------------------------------------------------- example

SMALL = ["--batch", "8", "--seq", "32", "--layers", "1", "--hidden", "32", "--heads", "2",
         "--ffn", "32", "--experts", "8", "--top-k", "2", "--eval-every", "3",
         "--eval-batches", "1", "--ckpt-every", "100", "--no-progress"]


def _train(out, *extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    # The runs of one test compile the same programs: they share a compilation cache.
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(str(out)), "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe.py"),
                        *SMALL, "--out", str(out), *extra], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], r.stdout


def test_train_script_runs_and_resumes_exactly(tmp_path):
    full, stdout = _train(tmp_path / "full", "--steps", "5")
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5]
    for r in full:
        for k in ("loss", "tokens_per_s", "max_expert_load", "mean_expert_load"):
            assert np.isfinite(r[k]), (k, r)
    assert "eval_loss" in full[2] and "eval_loss" in full[4]
    for name in ("loss.png", "expert_load.png"):
        assert os.path.getsize(tmp_path / "full" / name) > 1000
        assert name in stdout
    # Interrupted after step 2, then resumed: the same loss sequence, bit for bit.
    _train(tmp_path / "cut", "--steps", "5", "--stop-after", "2")
    resumed, _ = _train(tmp_path / "cut", "--steps", "5", "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert resumed[4]["eval_loss"] == full[4]["eval_loss"]
