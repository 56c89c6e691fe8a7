"""Remat and scan: `jax.checkpoint` (and `nnx.remat`) around code with EP ops inside, and
`jax.lax.scan` over layers, give the gradients of the plain program, on the ffi and
reference backends, for every op (dispatch, combine, cached dispatch, low-latency
dispatch and combine) and the global view; the checkpointed program really recomputes
the exchange in the backward pass; and the EP custom calls lowered for CUDA carry no
side effect (a side-effecting call cannot be rematerialized). Small shapes, 8 CPU
devices."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_ep
import jax_ep.low_latency as ll
import jax_ep.sharded as sh
from jax_ep import config, ops
from conftest import ep_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

R, T, H, K, E, M, L = 4, 6, 8, 2, 8, 8, 3
BACKENDS = ["ffi", "reference"]
OPS = ["normal", "cached", "low_latency"]
EP_TARGET = re.compile(r"custom_call @(jax_ep_\w+)\(")
# Remat and scan change how XLA fuses the float32 arithmetic around the exchange, so the
# gradients differ from the plain program's in the last bits (up to ~1e-5 relative on
# jax 0.12's CPU backend); a wrong exchange or a missed recompute is off by far more.
REMAT_RTOL, REMAT_ATOL = 1e-4, 2e-5


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    # Distinct experts per token (the low-latency mode's rule), one slot unused.
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    idx[::5, 1] = -1
    wts = rng.random((R * T, K)).astype(np.float32)
    ws = (rng.standard_normal((L, H, H)) * 0.3).astype(np.float32)
    return x, idx, wts, ws


def moe_block(op, backend):
    """One MoE-like layer per shard: x[T, H] -> [T, H] through the EP op `op`, with an
    expert matmul by w[H, H] on the received rows."""
    def block(x, w, idx, wts):
        if op == "low_latency":
            kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend=backend)
            recv, _, h = ll.dispatch(x, idx, **kw)
            y = jnp.tanh(recv @ w)
            return ll.combine(y, idx, wts, h, backend=backend) + x
        rx, _, rw, h = ops.dispatch(x, idx, wts, num_experts=E, axis_name="ep",
                                    backend=backend)
        if op == "cached":  # a second exchange through the same handle
            rx = rx + ops.cached_dispatch(jnp.sin(x), h, backend=backend)
        y = jnp.tanh(rx @ w) * jnp.sum(rw, axis=1, keepdims=True)
        return ops.combine(y, h, backend=backend) + x
    return block


def _loss_fn(op, backend, how):
    block = moe_block(op, backend)
    if how in ("checkpoint", "scan_checkpoint"):
        block = jax.checkpoint(block)

    def loss(x, ws, idx, wts):
        if how.startswith("scan"):
            def step(h, w):
                return block(h, w, idx, wts), None
            h, _ = jax.lax.scan(step, x, ws)
        else:
            h = x
            for i in range(L):
                h = block(h, ws[i], idx, wts)
        return jnp.sum(h ** 2)

    return loss


def _grads(op, backend, how, args):
    loss = _loss_fn(op, backend, how)

    def f(x, ws, idx, wts):
        v, (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1))(x, ws, idx, wts)
        return v[None], gx, gw

    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=(P("ep"), P(), P("ep"), P("ep")),
                              out_specs=(P("ep"), P("ep"), P("ep")), check_vma=False))
    x, idx, wts, ws = args
    return [np.asarray(a) for a in g(x, ws, idx, wts)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_and_scan_give_the_plain_gradients(op, backend):
    args = _inputs(1)
    plain = _grads(op, backend, "plain", args)
    assert np.abs(plain[2]).sum() > 0  # the weights get a gradient at all
    for how in ("checkpoint", "scan", "scan_checkpoint"):
        got = _grads(op, backend, how, args)
        for name, a, b in zip(("loss", "d_x", "d_w"), plain, got):
            np.testing.assert_allclose(b, a, rtol=REMAT_RTOL, atol=REMAT_ATOL,
                                       err_msg=f"{how} {name}")


def test_backends_agree_under_scan_and_checkpoint():
    """The oracle: ffi and reference give the same rematerialized, scanned gradients."""
    args = _inputs(2)
    for op in OPS:
        a = _grads(op, "ffi", "scan_checkpoint", args)
        b = _grads(op, "reference", "scan_checkpoint", args)
        for u, v in zip(a, b):
            # float32 sums in another order (XLA fuses the reference backend's pure-JAX
            # exchange around the call order's barriers differently between JAX
            # releases): a few units in the last place of the largest entry
            ulps = 4 * float(np.spacing(np.float32(np.abs(v).max())))
            np.testing.assert_allclose(u, v, rtol=2e-6, atol=max(2e-6, ulps), err_msg=op)


def _lowered(op, how, platform, policy=None):
    block = moe_block(op, "ffi")
    if how == "checkpoint":
        block = jax.checkpoint(block, policy=policy)

    def f(x, w, idx, wts):
        return jax.grad(lambda x, w: jnp.sum(block(x, w, idx, wts) ** 2), argnums=(0, 1))(
            x, w)

    x, idx, wts, ws = _inputs()
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=(P("ep"), P(), P("ep"), P("ep")),
                              out_specs=(P("ep"), P()), check_vma=False))
    return g.trace(x, ws[0], idx, wts).lower(lowering_platforms=(platform,)).as_text()


FORWARD_TARGET = {"normal": "jax_ep_dispatch", "cached": "jax_ep_gather",
                  "low_latency": "jax_ep_ll_dispatch_send"}


@pytest.mark.parametrize("op", OPS)
def test_checkpoint_recomputes_the_exchange(op):
    """With nothing saved, the backward pass re-runs the forward EP calls: the checkpoint
    really spans them (a side-effecting or otherwise pinned call would not be re-run)."""
    target = FORWARD_TARGET[op]
    plain = EP_TARGET.findall(_lowered(op, "plain", "cpu"))
    remat = EP_TARGET.findall(
        _lowered(op, "checkpoint", "cpu", jax.checkpoint_policies.nothing_saveable))
    assert remat.count(target) > plain.count(target) >= 1, (plain, remat)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_cuda_ep_calls_have_no_side_effect(op, stream):
    """Lowered for CUDA (with and without the collective-stream region), under
    jax.checkpoint: every EP custom call is free of `has_side_effect`, and the traced
    program has no effects that would stop remat (the call order is threaded as values,
    jax_ep/_src/ordering.py)."""
    with config.override(collective_stream=stream):
        text = _lowered(op, "checkpoint", "cuda")
        block = jax.checkpoint(moe_block(op, "ffi"))
        x, idx, wts, ws = _inputs()
        jaxpr = jax.make_jaxpr(jax.shard_map(
            lambda x, w, i, v: jax.grad(lambda x: jnp.sum(block(x, w, i, v)))(x),
            mesh=ep_mesh(R), in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"),
            check_vma=False))(x, ws[0], idx, wts)
    assert len([ln for ln in text.splitlines() if EP_TARGET.search(ln)]) >= 3
    assert side_effecting_ep_calls(text) == []
    assert not jaxpr.effects, jaxpr.effects  # ordered by values, no effect to allow
    assert ("_xla_stream_annotation" in text) == stream


def side_effecting_ep_calls(text: str) -> list:
    return [ln for ln in text.splitlines()
            if EP_TARGET.search(ln) and "has_side_effect = true" in ln]


def test_the_side_effect_check_can_fail():
    text = _lowered("normal", "checkpoint", "cuda")
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if "custom_call @jax_ep_dispatch(" in ln)
    lines[i] = lines[i].replace(") {", ") {has_side_effect = true, ", 1)
    assert len(side_effecting_ep_calls("\n".join(lines))) == 1


# ----------------------------------------------------------------------------- global view

def _global_grads(backend, how, args):
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    x, idx, wts, ws = (np.concatenate([a, a]) if a.ndim == 2 else a for a in args)

    def block(h, w):
        rx, _, rw, hd = sh.dispatch(h, idx, wts, num_experts=2 * E, mesh_axis="expert",
                                    backend=backend)
        y = jnp.tanh(rx @ w) * jnp.sum(rw, axis=1, keepdims=True)
        return sh.combine(y, hd, backend=backend) + h

    if how == "checkpoint":
        block = jax.checkpoint(block)

    def loss(x, ws):
        if how == "scan":
            h, _ = jax.lax.scan(lambda h, w: (jax.checkpoint(block)(h, w), None), x, ws)
        else:
            h = x
            for i in range(L):
                h = block(h, ws[i])
        return jnp.sum(h ** 2)

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ws)
    return [np.asarray(out[0]), np.asarray(out[1][0]), np.asarray(out[1][1])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_view_checkpoint_and_scan(backend):
    args = _inputs(3)
    plain = _global_grads(backend, "plain", args)
    for how in ("checkpoint", "scan"):
        for a, b in zip(plain, _global_grads(backend, how, args)):
            np.testing.assert_allclose(b, a, rtol=REMAT_RTOL, atol=REMAT_ATOL, err_msg=how)


# ----------------------------------------------------------------------------- Flax layer

def test_flax_layer_under_nnx_remat_and_scan_over_layers():
    """nnx.remat around the MoE layer, and lax.scan over a stack of layers (states
    stacked, each step merges one, checkpointed): the gradients of the plain layers."""
    from flax import nnx

    from jax_ep.flax import MoE

    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    with jax.set_mesh(mesh):
        layers = [MoE(16, 24, 8, 2, backend="ffi", rngs=nnx.Rngs(i)) for i in range(2)]
        graphdef, _ = nnx.split(layers[0])
        states = [nnx.state(m, nnx.Param) for m in layers]
        rest = nnx.state(layers[0], nnx.Not(nnx.Param))

        def apply(state, h):
            y, _ = nnx.merge(graphdef, state, rest)(h)
            return h + y

        def plain(states, x):
            h = x
            for s in states:
                h = apply(s, h)
            return jnp.sum(h ** 2)

        def remat(states, x):
            h = x
            for s in states:
                m = nnx.merge(graphdef, s, rest)
                y, _ = nnx.remat(lambda m, h: m(h))(m, h)
                h = h + y
            return jnp.sum(h ** 2)

        def scanned(states, x):
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
            h, _ = jax.lax.scan(lambda h, s: (jax.checkpoint(apply)(s, h), None), x,
                                stacked)
            return jnp.sum(h ** 2)

        # One program at a time: two EP programs in flight at once on the CPU devices of
        # one process may meet in the CPU transport's rendezvous.
        ref = jax.block_until_ready(jax.jit(jax.grad(plain))(states, x))
        for f in (remat, scanned):
            got = jax.block_until_ready(jax.jit(jax.grad(f))(states, x))
            leaves_a, leaves_b = jax.tree.leaves(ref), jax.tree.leaves(got)
            assert len(leaves_a) == len(leaves_b) > 0
            assert any(np.abs(np.asarray(a)).sum() > 0 for a in leaves_a)
            for a, b in zip(leaves_a, leaves_b):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5,
                                           atol=2e-6, err_msg=f.__name__)
