"""Autodiff per the contract: dispatch's cotangent for x is the combine of recv_x's
cotangent, for topk_weights it comes back from the owning rank (zero where dropped);
combine's cotangent for y is the dispatch of out's cotangent through the same handle."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ep
from conftest import (BACKENDS, assert_bitwise_equal, ep_mesh, np_combine, np_gather,
                      np_model)
from test_ops import make_inputs, make_routing

F32 = jnp.float32


@functools.lru_cache(maxsize=None)
def _grad_fn(R, E, C, backend):
    """Gradient of sum(recv_x * A) + sum(recv_w * B) + sum(combine(y) * G) with respect
    to (x, topk_weights, y), for global inputs sharded over R ranks."""

    def per_shard(x, idx, w, y, A, B, G):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                       capacity=C, backend=backend)
        out = jax_ep.combine(y, h, backend=backend)
        part = (jnp.sum(rx.astype(F32) * A) + jnp.sum(rw * B) +
                jnp.sum(out.astype(F32) * G))
        return part[None]

    sm = jax.shard_map(per_shard, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep"))

    def loss(x, w, y, idx, A, B, G):
        return jnp.sum(sm(x, idx, w, y, A, B, G))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _case(R, T, K, E, H, C, seed, dtype=F32, **routing):
    rng = np.random.default_rng(seed)
    idx = make_routing(rng, R, T, K, E, **routing)
    x, w, y = make_inputs(rng, R, T, K, H, C, dtype)
    A = rng.standard_normal((R, C, H)).astype(np.float32)
    B = rng.standard_normal((R, C, K)).astype(np.float32)
    G = rng.standard_normal((R, T, H)).astype(np.float32)
    return x, idx, w, y, A, B, G


def _run_grad(R, E, C, backend, x, idx, w, y, A, B, G):
    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    dx, dw, dy = _grad_fn(R, E, C, backend)(flat(x), flat(w), flat(y), flat(idx), flat(A),
                                             flat(B), flat(G))
    return dict(dx=np.asarray(dx).reshape(x.shape), dw=np.asarray(dw).reshape(w.shape),
                dy=np.asarray(dy).reshape(y.shape))


def _model_grads(x, idx, w, y, A, B, G, E, C):
    m = np_model(x, idx, w, y, E, C)
    dx = np_combine(A.astype(x.dtype), m["send_row"])
    # The weight cotangent counts only where the slot's expert lives on the receiver.
    dw = np_combine(np.where(m["recv_idx"] >= 0, B, np.float32(0)), m["send_row"])
    dy = np_gather(G, m["src_rank"], m["src_index"]).astype(y.dtype)
    return dict(dx=dx, dw=dw, dy=dy), m


# (R, T, K, E, H, C): no overflow, overflow, K=1 / T=1.
GRAD_CASES = [(4, 5, 2, 8, 3, 20), (4, 5, 3, 8, 2, 4), (8, 1, 1, 8, 2, 8)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=["full", "overflow", "k1_t1"])
def test_grads_match_contract_and_backends_agree(case):
    R, T, K, E, H, C = case
    args = _case(R, T, K, E, H, C, seed=sum(case), mask_frac=0.25)
    want, m = _model_grads(*args, E, C)
    got = {b: _run_grad(R, E, C, b, *args) for b in BACKENDS}
    assert_bitwise_equal(got["ffi"], got["reference"], what="ffi vs reference: ")
    assert_bitwise_equal(got["ffi"], want, what="ffi vs contract: ")
    assert np.abs(got["ffi"]["dx"]).sum() > 0 and np.abs(got["ffi"]["dw"]).sum() > 0


def test_grads_bfloat16_backends_agree():
    R, T, K, E, H, C = 4, 5, 2, 8, 3, 6
    args = _case(R, T, K, E, H, C, seed=4, dtype=jnp.bfloat16, mask_frac=0.25)
    got = {b: _run_grad(R, E, C, b, *args) for b in BACKENDS}
    assert got["ffi"]["dx"].dtype == jnp.bfloat16 and got["ffi"]["dy"].dtype == jnp.bfloat16
    assert_bitwise_equal(got["ffi"], got["reference"], what="ffi vs reference: ")
    want, _ = _model_grads(*args, E, C)
    assert_bitwise_equal(got["ffi"], want, ["dy", "dw"], what="ffi vs contract: ")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_rows_get_zero_gradient(backend):
    R, T, K, E, H, C = 4, 5, 2, 8, 2, 3
    x, idx, w, y, _, _, G = _case(R, T, K, E, H, C, seed=8)
    idx[:, :, :] = 0  # every token goes to expert 0 only: rank 0 keeps 3 of 20 rows
    A = np.ones((R, C, H), np.float32)
    B = np.ones((R, C, K), np.float32)
    g = _run_grad(R, E, C, backend, x, idx, w, y, A, B, G)
    kept = np.zeros((R, T), bool)
    kept[0, :3] = True  # the first C rows in (source rank, token) order
    np.testing.assert_array_equal(g["dx"][kept], 1.0)
    np.testing.assert_array_equal(g["dx"][~kept], 0.0)
    np.testing.assert_array_equal(g["dw"][kept], 1.0)  # both slots name expert 0
    np.testing.assert_array_equal(g["dw"][~kept], 0.0)
    # Rows past num_recv (none here beyond C) and other ranks' empty rows: zero.
    np.testing.assert_array_equal(g["dy"][1:], 0.0)
    np.testing.assert_array_equal(g["dy"][0], G[0, :3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_grads(backend):
    R, T, K, E, H, C = 4, 3, 2, 8, 2, 7  # some rows dropped
    rng = np.random.default_rng(12)
    idx = make_routing(rng, R, T, K, E, mask_frac=0.2).reshape(R * T, K)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    w = rng.random((R * T, K)).astype(np.float32)
    y = rng.standard_normal((R * C, H)).astype(np.float32)

    def per_shard(x, idx, w, y):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                       capacity=C, backend=backend)
        z = jnp.sin(rx) * (1.0 + rw.sum(1, keepdims=True)) + y * y
        return jax_ep.combine(z, h, backend=backend)

    sm = jax.shard_map(per_shard, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep"))
    f = jax.jit(lambda x, w, y: sm(x, idx, w, y))
    check_grads(f, (x, w, y), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)
