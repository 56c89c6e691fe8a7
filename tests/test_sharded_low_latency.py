"""Global view of the low-latency mode (jax_ep._src.sharded_low_latency): the same numbers as
the per-shard contract, gradients, errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ep
import jax_ep._src.sharded_low_latency  # noqa: F401 - the global view of the mode
from conftest import BACKENDS, ep_mesh_2d
from jax_ep import low_latency as ll
from test_low_latency import np_combine, np_dispatch, routing

D, R, T, M, H, K, E = 2, 4, 5, 6, 16, 3, 8
EL = E // R
N = D * R * T


def _inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, H)).astype(dtype)
    idx = routing(rng, "random", Rn=D * R, Tn=T).reshape(N, K)
    w = rng.random((N, K)).astype(np.float32)
    return x, idx, w


def _global(backend, mesh, fp8=False):
    kw = dict(num_experts=E, mesh_axis="expert", max_tokens_per_rank=M, backend=backend)

    @jax.jit
    def f(x, idx, w):
        recv, cnt, h = jax_ep._src.sharded_low_latency.dispatch(x, idx, fp8=fp8, **kw)
        y = recv if not fp8 else jnp.zeros(recv[0].shape, jnp.float32)
        out = jax_ep._src.sharded_low_latency.combine(y, idx, w, h, backend=backend)
        return recv, cnt, h.src_rank, h.src_index, h.first_row, h.row_count, out

    def call(*args):
        with jax.set_mesh(mesh):
            return f(*args)

    return call


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_view_matches_model_per_group(backend):
    mesh = ep_mesh_2d(D, R)
    x, idx, w = _inputs(0)
    recv, cnt, sr, si, first, rows, out = jax.tree.map(
        np.asarray, _global(backend, mesh)(x, idx, w))
    xs, ids, ws = (a.reshape(D, R, T, -1) for a in (x, idx, w))
    for d in range(D):  # each index of the data axis is its own EP group
        model = np_dispatch(xs[d], ids[d], E, M)
        blk = slice(d * R * EL, (d + 1) * R * EL)
        np.testing.assert_array_equal(recv[blk].reshape(R, EL, R * M, H), model["recv"])
        np.testing.assert_array_equal(cnt[blk].reshape(R, EL), model["count"])
        np.testing.assert_array_equal(sr[blk].reshape(R, EL, R * M), model["src_rank"])
        np.testing.assert_array_equal(si[blk].reshape(R, EL, R * M), model["src_index"])
        np.testing.assert_array_equal(first[blk].reshape(R, EL, R), model["first_row"])
        np.testing.assert_array_equal(rows[blk].reshape(R, EL, R), model["row_count"])
        want = np_combine(model["recv"], ids[d], ws[d], model)
        np.testing.assert_array_equal(out[d * R * T:(d + 1) * R * T].reshape(R, T, H), want)


def test_global_and_per_shard_views_agree_bitwise():
    mesh = ep_mesh_2d(D, R)
    x, idx, w = _inputs(1, np.dtype(jnp.bfloat16))
    g = jax.tree.map(np.asarray, _global("ffi", mesh)(x, idx, w))

    def per(x, idx, w):
        recv, cnt, h = ll.dispatch(x, idx, num_experts=E, axis_name="expert",
                                   max_tokens_per_rank=M, backend="reference")
        return recv, cnt, ll.combine(recv, idx, w, h, backend="reference")

    spec = P(("data", "expert"))
    recv, cnt, out = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=spec, out_specs=spec))(
        x, idx, w)
    for a, b in ((g[0], recv), (g[1], cnt), (g[6], out)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_gradients_numerically(backend):
    mesh = ep_mesh_2d(D, R)
    x, idx, w = _inputs(2)
    kw = dict(num_experts=E, mesh_axis="expert", max_tokens_per_rank=M, backend=backend)

    def f(x, w):
        recv, _, h = jax_ep._src.sharded_low_latency.dispatch(x, idx, **kw)
        return jax_ep._src.sharded_low_latency.combine(jnp.tanh(recv), idx, w, h, backend=backend)

    with jax.set_mesh(mesh):
        check_grads(jax.jit(f), (x, w), order=1, modes=("rev",), atol=2e-2, rtol=2e-2,
                    eps=1e-2)


def test_global_fp8_dispatch_matches_quantize():
    mesh = ep_mesh_2d(D, R)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 128)).astype(np.float32)
    idx = routing(rng, "random", Rn=D * R, Tn=T).reshape(N, K)
    (q, s), cnt, *_ = _global("ffi", mesh, fp8=True)(x, idx, np.ones((N, K), np.float32))
    wq, ws = jax_ep.fp8.quantize(jnp.asarray(x))
    model = np_dispatch(np.asarray(ws).reshape(D * R, T, 1)[:R], idx.reshape(D * R, T, K)[:R],
                        E, M)
    np.testing.assert_array_equal(np.asarray(s)[:R * EL].reshape(R, EL, R * M, 1),
                                  model["recv"])
    assert q.dtype == jax_ep.fp8.FP8_DTYPE


def test_global_errors():
    mesh = ep_mesh_2d(D, R)
    x, idx, w = _inputs(4)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"T=5 tokens per rank, more than "
                                             r"max_tokens_per_rank=4"):
            jax_ep._src.sharded_low_latency.dispatch(x, idx, num_experts=E, mesh_axis="expert",
                                                max_tokens_per_rank=4)
        with pytest.raises(TypeError, match="ShardedLowLatencyHandle"):
            jax_ep._src.sharded_low_latency.combine(x, idx, w, None)
