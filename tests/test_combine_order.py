"""Combine's summation order (kernels/common/combine_order.h), the same in every backend:
per node of G ranks (JAX_EP_GPUS_PER_NODE; one node by default on CPU) in ascending rank
order in float32, each node's partial rounded to the row dtype when there are several
nodes, then the partials over nodes ascending in float32, bias after, one cast.

The reference and the CPU ffi backend agree bit for bit at 8 ranks for every node size
(random routing, bf16 and f32, with bias), and both give the hand-computed results of a
case where each way of getting the order wrong changes the bf16 result."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import BACKENDS, assert_bitwise_equal, ep_mesh
from test_ops import make_inputs, make_routing

F32, BF16 = jnp.float32, jnp.bfloat16
ENV = "JAX_EP_GPUS_PER_NODE"


def _run(backend, x, idx, w, y, biases, *, E, C):
    """jit(shard_map(dispatch + combine)) traced afresh (the node size is read when the
    combine is traced): (out[R, T, H], send_row[R, T, R])."""
    R = idx.shape[0]

    def f(x, idx, w, y, *b):
        _, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", capacity=C,
                                     backend=backend)
        bias = None if not b else (b[0] if len(b) == 1 else tuple(b))
        return jax_ep.combine(y, h, bias=bias, backend=backend), h.send_row[None]

    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    out, send_row = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"),
                                          out_specs=P("ep")))(
        *[flat(a) for a in (x, idx, w, y, *biases)])
    return np.asarray(out).reshape(R, -1, y.shape[-1]), np.asarray(send_row)


def _node_size(G):
    """The node size of combine's order for the calls inside (jax_ep.config, ENV)."""
    import jax_ep
    return jax_ep.config.override(gpus_per_node=G)


def np_order(y, send_row, biases, G):
    """NumPy statement of the order: out[s, t] from the rows y[r, send_row[s, t, r]]."""
    R, T = send_row.shape[:2]
    G = R if G is None else G
    dt = y.dtype
    out = np.zeros((R, T, y.shape[-1]), dt)
    for s in range(R):
        acc = np.zeros((T, y.shape[-1]), np.float32)
        for n in range(0, R, G):
            part = np.zeros_like(acc)
            for r in range(n, n + G):
                rows = send_row[s, :, r]
                part[rows >= 0] += np.asarray(y[r], np.float32)[rows[rows >= 0]]
            acc = acc + (part.astype(dt).astype(np.float32) if G < R else part)
        for b in biases:
            acc = acc + np.asarray(b[s], np.float32)
        out[s] = acc.astype(dt)
    return out


# -------------------------------------------------------------- random routing, 8 ranks

R, T, K, E, H, C = 8, 5, 3, 16, 6, 24


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(G=st.sampled_from([None, 1, 2, 4]), dtype=st.sampled_from([F32, BF16]),
       n_bias=st.sampled_from([0, 1, 2]), mask_frac=st.sampled_from([0.0, 0.3]),
       skew_to=st.one_of(st.none(), st.integers(0, R - 1)), seed=st.integers(0, 2**31 - 1))
def test_reference_equals_cpu_ffi_for_every_node_size(G, dtype, n_bias, mask_frac, skew_to,
                                                      seed):
    rng = np.random.default_rng(seed)
    idx = make_routing(rng, R, T, K, E, mask_frac=mask_frac, skew_to=skew_to)
    x, w, y = make_inputs(rng, R, T, K, H, C, dtype)
    # large and small rows mixed, so the partials' rounding and the order show in bf16
    y = (np.asarray(y, np.float32) * np.exp2(rng.integers(-8, 9, size=y.shape))).astype(
        np.asarray(y).dtype)
    biases = [np.asarray(jnp.asarray(rng.standard_normal((R, T, H)), bd))
              for bd in (F32, BF16)[:n_bias]]
    with _node_size(G):
        ref, send_row = _run("reference", x, idx, w, y, biases, E=E, C=C)
        ffi, send_row_ffi = _run("ffi", x, idx, w, y, biases, E=E, C=C)
    np.testing.assert_array_equal(send_row, send_row_ffi)
    assert_bitwise_equal({"out": ffi}, {"out": ref}, what=f"G={G} ffi vs reference: ")
    want = np_order(np.asarray(y), send_row, biases, G)
    assert_bitwise_equal({"out": ref}, {"out": want}, what=f"G={G} reference vs model: ")


def test_unset_and_one_and_eight_are_todays_order():
    """G unset, 1 and 8 (= R) all give the plain ascending float32 sum over ranks."""
    rng = np.random.default_rng(3)
    idx = make_routing(rng, R, T, K, E)
    x, w, y = make_inputs(rng, R, T, K, H, C, BF16)
    outs = {}
    for G in (None, 1, 8):
        with _node_size(G):
            outs[G], send_row = _run("ffi", x, idx, w, y, [], E=E, C=C)
    want = np_order(np.asarray(y), send_row, [], None)
    for G, out in outs.items():
        assert_bitwise_equal({"out": out}, {"out": want}, what=f"G={G}: ")


# ------------------------------------------------------------------- hand-computed case
# 8 ranks, one token each, every token on every rank (expert r on rank r), so receiver r's
# row s is source s's token. Source 0's token comes back with the rows below; each node
# size gives a different bf16 result, and so does each mistake:
#   G=2, right:              partials 2^30, -2^30, bf16(1 + 2^-8) = 1 (tie to even), 2^-8;
#                            sum 1 + 2^-8 -> bf16 1.0
#   G=2, partial unrounded:  1 + 2^-8 + 2^-8 = 1 + 2^-7 -> 1.0078125
#   G=2, nodes descending:   2^-8 + 1 - 2^30 = -2^30 in float32, + 2^30 -> 0.0
#   G=4:                     partials 0, 1 + 2^-7; -> 1.0078125
#   one node (unset, 1, 8):  1 + 2^-7 -> 1.0078125
HAND_ROWS = [2.0 ** 30, 0.0, -2.0 ** 30, 0.0, 1.0, 2.0 ** -8, 2.0 ** -8, 0.0]
HAND_WANT = {None: 1.0078125, 1: 1.0078125, 2: 1.0, 4: 1.0078125, 8: 1.0078125}


@pytest.mark.parametrize("G", [None, 1, 2, 4, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_node_order(backend, G):
    Rh, Eh, Ch, Hh = 8, 8, 8, 2
    idx = np.tile(np.arange(Eh, dtype=np.int32), (Rh, 1, 1))  # [R, 1, K=8]
    x = np.ones((Rh, 1, Hh), np.float32).astype(BF16)
    w = np.ones((Rh, 1, Eh), np.float32)
    y = np.zeros((Rh, Ch, Hh), np.float32)
    y[:, 0, 0] = HAND_ROWS  # receiver r's row 0: source 0's token
    y[:, 0, 1] = 1.0        # column 1: 8 ones in any order
    y = y.astype(BF16)
    with _node_size(G):
        out, send_row = _run(backend, x, idx, w, y, [], E=Eh, C=Ch)
    assert (send_row[0, 0] == 0).all()  # source 0's token is row 0 everywhere
    assert float(out[0, 0, 0]) == HAND_WANT[G], (G, float(out[0, 0, 0]))
    assert float(out[0, 0, 1]) == 8.0


def test_bad_node_size_is_a_clear_error():
    with _node_size(3):
        with pytest.raises(ValueError, match="gpus_per_node|" + ENV):
            _run("reference", *_tiny(), [], E=8, C=8)


def _tiny():
    x = np.ones((8, 1, 2), np.float32)
    idx = np.zeros((8, 1, 1), np.int32)
    w = np.ones((8, 1, 1), np.float32)
    y = np.ones((8, 8, 2), np.float32)
    return x, idx, w, y


def test_node_size_sources():
    """G: JAX_EP_GPUS_PER_NODE first; else one node on CPU (a launcher's local size does
    not split CPU devices); else the topology (the launcher's local size on GPUs)."""
    from jax_ep.network.topology import combine_node_size
    assert combine_node_size(8, "cpu", environ={}) == 8
    assert combine_node_size(8, "cpu", environ={ENV: "2"}) == 2
    assert combine_node_size(8, "cpu", environ={"LOCAL_WORLD_SIZE": "4"}) == 8
    assert combine_node_size(8, "gpu", environ={"LOCAL_WORLD_SIZE": "4"}) == 4
    assert combine_node_size(8, "gpu", environ={}) == 8
    with pytest.raises(ValueError, match=ENV):
        combine_node_size(8, "cpu", environ={ENV: "3"})
