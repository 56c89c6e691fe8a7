"""DeepSeek routing options of jax_ep.flax.MoE: routed_scaling_factor, the sequence-wise
balance loss, the V2 group score (a group's max)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ep.flax import MoE, route, sequence_balance_loss

AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:8])


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _grads(moe, x):
    def loss(m):
        y, aux = m(x)
        return jnp.sum(jnp.sin(y)), y

    (_, y), g = nnx.jit(lambda m: nnx.value_and_grad(loss, has_aux=True)(m))(moe)
    return y, g


def test_routed_scaling_factor_vs_scaled_w_down(mesh):
    """factor s on the routed weights == s * w_down (the shared expert unscaled): same
    outputs and gradients, except w_down's, which is s times the folded model's."""
    s = 2.5
    x = _x((4, 16, 16), seed=1)
    cfg = dict(score="sigmoid", n_groups=4, topk_groups=2, shared_experts=1,
               capacity_factor=None)
    with jax.set_mesh(mesh):
        scaled = MoE(16, 24, 8, 3, routed_scaling_factor=s, rngs=nnx.Rngs(5), **cfg)
        folded = MoE(16, 24, 8, 3, rngs=nnx.Rngs(5), **cfg)
        y1, _ = _grads(folded, x)
        folded.w_down[...] = folded.w_down[...] * s
        ya, ga = _grads(scaled, x)
        yb, gb = _grads(folded, x)
    assert float(jnp.abs(ya - y1).max()) > 1e-2  # the factor does change the output
    np.testing.assert_allclose(ya, yb, rtol=1e-5, atol=1e-5)
    for name in ("router", "w_gate", "w_up"):  # float32 rounding of two summation paths
        np.testing.assert_allclose(ga[name][...], gb[name][...], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ga["shared"]["w_down"][...], gb["shared"]["w_down"][...],
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ga["w_down"][...], s * gb["w_down"][...], rtol=1e-4,
                               atol=1e-6)


def _np_sequence_loss(logits, idx, E, score):
    """NumPy, float64: mean over sequences of E * sum_e f_e * P_e (V3's L_Bal / alpha)."""
    logits = np.asarray(logits, np.float64)
    if score == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
    else:
        p = 1 / (1 + np.exp(-logits))
    p /= p.sum(-1, keepdims=True)
    B, S, K = idx.shape
    out = []
    for b in range(B):
        counts = np.bincount(idx[b].reshape(-1), minlength=E)
        f = E * counts / (K * S)
        out.append(np.sum(f * p[b].mean(0)))
    return float(np.mean(out))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_balance_loss_matches_numpy(mesh, score):
    B, S, H, E, K = 4, 16, 16, 8, 2
    x = _x((B, S, H), seed=2)
    with jax.set_mesh(mesh):
        moe = MoE(H, 24, E, K, score=score, aux_loss="sequence", rngs=nnx.Rngs(6))
        _, aux = nnx.jit(lambda m, x: m(x))(moe, x)
        batch = MoE(H, 24, E, K, score=score, rngs=nnx.Rngs(6))
        _, aux_b = nnx.jit(lambda m, x: m(x))(batch, x)
    logits = np.asarray(x.reshape(-1, H) @ moe.router[...]).reshape(B, S, E)
    idx = np.asarray(route(jnp.asarray(logits.reshape(-1, E)), K, score=score)[0])
    want = _np_sequence_loss(logits, idx.reshape(B, S, K), E, score)
    np.testing.assert_allclose(float(aux["sequence_balance_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(aux["load_balance_loss"]), want, rtol=1e-5)
    # The batch-wide loss is the same form over all B * S tokens, and differs here.
    np.testing.assert_allclose(float(aux_b["load_balance_loss"]),
                               _np_sequence_loss(logits.reshape(1, B * S, E),
                                                 idx.reshape(1, B * S, K), E, score),
                               rtol=1e-5)
    np.testing.assert_allclose(float(aux["batch_balance_loss"]),
                               float(aux_b["load_balance_loss"]), rtol=1e-6)
    assert abs(want - float(aux_b["load_balance_loss"])) > 1e-4


def test_sequence_balance_loss_gradient_reaches_router(mesh):
    x = _x((2, 16, 16), seed=3)
    with jax.set_mesh(mesh):
        moe = MoE(16, 16, 8, 2, aux_loss="sequence", rngs=nnx.Rngs(0))
        g = nnx.jit(nnx.grad(lambda m: m(x)[1]["load_balance_loss"]))(moe)
    assert float(jnp.abs(g["router"][...]).sum()) > 0
    assert float(jnp.abs(g["w_gate"][...]).sum()) == 0


def test_sequence_balance_loss_uniform_is_one():
    E, K, S = 4, 2, 8
    idx = jnp.asarray(np.tile([[0, 1], [2, 3]], (1, S // 2, 1)), jnp.int32)  # [1, S, K]
    probs = jnp.full((1, S, E), 1 / E)
    np.testing.assert_allclose(float(sequence_balance_loss(probs, idx, E)), 1.0,
                               rtol=1e-6)


def _np_group_max_route(logits, K, G, topk_groups):
    """DeepSeek-V2 group-limited greedy: softmax scores, groups by their best score."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    N, E = p.shape
    per = E // G
    out = []
    for t in range(N):
        gbest = p[t].reshape(G, per).max(1)
        keep = np.argsort(-gbest, kind="stable")[:topk_groups]
        masked = np.where(np.repeat(np.isin(np.arange(G), keep), per), p[t], -np.inf)
        out.append(np.argsort(-masked, kind="stable")[:K])
    return np.asarray(out)


def test_group_score_max_matches_numpy():
    logits = np.asarray(_x((64, 16), seed=4)) * 3
    idx, w, _ = route(jnp.asarray(logits), 3, n_groups=4, topk_groups=2,
                      group_score="max", norm_topk_prob=False)
    np.testing.assert_array_equal(np.sort(idx, 1),
                                  np.sort(_np_group_max_route(logits, 3, 4, 2), 1))
    top2, _, _ = route(jnp.asarray(logits), 3, n_groups=4, topk_groups=2)
    assert np.any(np.sort(top2, 1) != np.sort(idx, 1))  # the two scores differ here


def test_option_errors():
    with pytest.raises(ValueError, match="group_score"):
        MoE(16, 16, 8, 2, group_score="mean", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="aux_loss"):
        MoE(16, 16, 8, 2, aux_loss="token", rngs=nnx.Rngs(0))
    for bad in (0, -1.0, True, "2.5"):
        with pytest.raises(ValueError, match="routed_scaling_factor"):
            MoE(16, 16, 8, 2, routed_scaling_factor=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="group_score"):
        route(jnp.zeros((4, 8)), 2, n_groups=2, topk_groups=1, group_score="sum")
