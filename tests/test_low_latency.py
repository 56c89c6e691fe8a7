"""Low-latency mode (jax_ep.low_latency), per shard: rows, counts and handle against a
NumPy model of the contract, weighted combine, errors, gradients, the send/receive
split, FP8, and every backend bit-exact with the reference."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from conftest import BACKENDS, ep_mesh
from jax_ep import fp8 as fp8_lib
from jax_ep import low_latency as ll

RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError, RuntimeError)
R, T, M, H, K, E = 4, 6, 8, 16, 3, 8
EL = E // R


# ----------------------------------------------------------------------------- model

def np_dispatch(x, idx, E, M):
    """NumPy model of the contract for x[R, T, H], idx[R, T, K]: per receiving rank
    recv[R, E_local, R*M, H], count[R, E_local], src_rank/src_index[R, E_local, R*M],
    first_row/row_count[R, E_local, R]."""
    Rn, Tn, Hn = x.shape
    el = E // Rn
    recv = np.zeros((Rn, el, Rn * M, Hn), x.dtype)
    src_rank = np.full((Rn, el, Rn * M), -1, np.int32)
    src_index = np.full((Rn, el, Rn * M), -1, np.int32)
    first = np.zeros((Rn, el, Rn), np.int32)
    rows = np.zeros((Rn, el, Rn), np.int32)
    count = np.zeros((Rn, el), np.int32)
    for r in range(Rn):
        for e in range(el):
            g, row = r * el + e, 0
            for s in range(Rn):
                first[r, e, s] = row
                for t in range(Tn):
                    if g in idx[s, t]:
                        recv[r, e, row] = x[s, t]
                        src_rank[r, e, row], src_index[r, e, row] = s, t
                        row += 1
                rows[r, e, s] = row - first[r, e, s]
            count[r, e] = row
    return dict(recv=recv, count=count, src_rank=src_rank, src_index=src_index,
                first_row=first, row_count=rows)


def np_combine(y, idx, w, model):
    """out[R, T, H]: sum over k ascending of w * y_row in float32 steps, cast to y's dtype."""
    Rn, el = y.shape[:2]
    Tn, Kn = idx.shape[1:]
    out = np.zeros((Rn, Tn, y.shape[-1]), y.dtype)
    for s in range(Rn):
        for t in range(Tn):
            acc = np.zeros(y.shape[-1], np.float32)
            for k in range(Kn):
                g = idx[s, t, k]
                if g < 0:
                    continue
                r, e = g // el, g % el
                j = sum(g in idx[s, u] for u in range(t))
                row = model["first_row"][r, e, s] + j
                acc = acc + np.float32(w[s, t, k]) * y[r, e, row].astype(np.float32)
            out[s, t] = acc.astype(y.dtype)
    return out


# ----------------------------------------------------------------------------- runner

@functools.lru_cache(maxsize=None)
def ll_program(Rn, En, Mn, backend, split=False, fp8=False):
    mesh = ep_mesh(Rn)

    def f(x, idx, w, y):
        kw = dict(num_experts=En, axis_name="ep", max_tokens_per_rank=Mn, backend=backend)
        if split:
            recv, cnt, h = ll.dispatch_recv(ll.dispatch_send(x, idx, fp8=fp8, **kw))
            out = ll.combine_recv(ll.combine_send(y[0], idx, w, h, backend=backend))
        else:
            recv, cnt, h = ll.dispatch(x, idx, fp8=fp8, **kw)
            out = ll.combine(y[0], idx, w, h, backend=backend)
        if fp8:
            recv = jax.tree.map(lambda a: a[None], recv)
        else:
            recv = recv[None]
        return dict(recv=recv, count=cnt[None], src_rank=h.src_rank[None],
                    src_index=h.src_index[None], first_row=h.first_row[None],
                    row_count=h.row_count[None], out=out[None])

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def run_ll(x, idx, w, y, *, backend, E=E, M=M, split=False, fp8=False):
    """x[R, T, H], idx/w[R, T, K], y[R, E_local, R*M, H] -> dict of per-rank NumPy arrays."""
    Rn = x.shape[0]
    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    res = ll_program(Rn, E, M, backend, split, fp8)(flat(x), flat(idx), flat(w), y)
    return jax.tree.map(np.asarray, res)


def routing(rng, kind, Rn=R, Tn=T, Kn=K, En=E):
    """idx[R, T, K] int32 without duplicate ids per token."""
    if kind == "masked":
        return np.full((Rn, Tn, Kn), -1, np.int32)
    if kind == "skewed":  # every token picks experts 0..K-1 (rank 0 gets all rows)
        idx = np.broadcast_to(np.arange(Kn, dtype=np.int32), (Rn, Tn, Kn)).copy()
        idx[:, ::3, -1] = -1
        return idx
    idx = np.stack([np.stack([rng.permutation(En)[:Kn] for _ in range(Tn)])
                    for _ in range(Rn)]).astype(np.int32)
    mask = rng.random((Rn, Tn, Kn)) < 0.2
    return np.where(mask, -1, idx).astype(np.int32)


def inputs(seed, kind="random", dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, T, H)).astype(dtype)
    idx = routing(rng, kind)
    w = rng.random((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, EL, R * M, H)).astype(dtype)
    return x, idx, w, y


def check_against_model(res, x, idx, w, y):
    model = np_dispatch(x, idx, E, M)
    for key in ("count", "src_rank", "src_index", "first_row", "row_count"):
        np.testing.assert_array_equal(res[key], model[key], err_msg=key)
    np.testing.assert_array_equal(res["recv"].view(np.uint8), model["recv"].view(np.uint8))
    want = np_combine(y, idx, w, model)
    np.testing.assert_array_equal(res["out"].view(np.uint8), want.view(np.uint8))


# ----------------------------------------------------------------------------- contract

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["random", "skewed", "masked"])
def test_rows_counts_and_combine_match_model(backend, kind):
    x, idx, w, y = inputs(1, kind)
    check_against_model(run_ll(x, idx, w, y, backend=backend), x, idx, w, y)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), drop=st.floats(0.0, 1.0))
def test_random_routing_matches_model_on_every_backend(seed, drop):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = routing(rng, "random")
    idx = np.where(rng.random(idx.shape) < drop, -1, idx).astype(np.int32)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, EL, R * M, H)).astype(np.float32)
    for backend in BACKENDS:
        check_against_model(run_ll(x, idx, w, y, backend=backend), x, idx, w, y)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backends_bit_exact_with_reference(dtype):
    x, idx, w, y = inputs(2, dtype=np.dtype(dtype))
    ref = run_ll(x, idx, w, y, backend="reference")
    check_against_model(ref, x, idx, w, y)
    for backend in BACKENDS[1:]:
        got = run_ll(x, idx, w, y, backend=backend)
        for key in ref:
            np.testing.assert_array_equal(np.asarray(got[key]).view(np.uint8),
                                          np.asarray(ref[key]).view(np.uint8), err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fewer_tokens_than_M(backend):
    """T < M: the buffers keep their size (R * M rows per expert)."""
    Tn = 3
    rng = np.random.default_rng(3)
    x = rng.standard_normal((R, Tn, H)).astype(np.float32)
    idx = routing(rng, "random", Tn=Tn)
    w = rng.random((R, Tn, K)).astype(np.float32)
    y = rng.standard_normal((R, EL, R * M, H)).astype(np.float32)
    res = run_ll(x, idx, w, y, backend=backend)
    assert res["recv"].shape == (R, EL, R * M, H)
    check_against_model(res, x, idx, w, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_recv_split_equals_fused(backend):
    x, idx, w, y = inputs(4)
    fused = run_ll(x, idx, w, y, backend=backend)
    split = run_ll(x, idx, w, y, backend=backend, split=True)
    for key in fused:
        np.testing.assert_array_equal(split[key], fused[key], err_msg=key)


def _fp8_edge_rows(rng, Hn, dtype):
    """x[R, T, H] with 1 x 128 blocks at FP8's edges: ties between FP8 neighbours at
    scale 1 (amax 448), values landing on FP8 subnormals, all-zero blocks, and blocks
    whose amax is below the floor."""
    x = rng.standard_normal((R, T, Hn)).astype(np.float32) * 3
    for r in range(R):
        for t in range(T):
            blk = x[r, t, ((r + t) % (Hn // 128)) * 128:][:128]
            kind = (r * T + t) % 5
            if kind == 1:
                blk[:] = rng.choice([448.0, -448.0, 424.0, 17.0, 0.59375, 0.53125, 440.0], 128)
            elif kind == 2:
                blk[:] = rng.choice([2.0 ** -9, 5 * 2.0 ** -10, 9 * 2.0 ** -10, 7 * 2.0 ** -10,
                                     2.0 ** -6, -3 * 2.0 ** -11, 5 * 2.0 ** -11], 128)
                blk[0] = -448.0
            elif kind == 3:
                blk[:] = 0.0
            elif kind == 4:
                blk[:] *= 1e-12
    return x.astype(dtype)


@functools.lru_cache(maxsize=None)
def _fp8_program(backend, round_scale, split):
    mesh = ep_mesh(R)

    def f(x, idx):
        kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, fp8=True,
                  round_scale=round_scale, backend=backend)
        if split:
            (q, s), cnt, h = ll.dispatch_recv(ll.dispatch_send(x, idx, **kw))
        else:
            (q, s), cnt, h = ll.dispatch(x, idx, **kw)
        return q[None], s[None], cnt[None], h.src_rank[None], h.src_index[None]

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


@pytest.mark.parametrize("backend", ["reference", "ffi"])
@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype,Hn", [(jnp.bfloat16, 256), (np.float32, 128)])
def test_fp8_dispatch(backend, round_scale, dtype, Hn):
    """recv pairs are jax_ep.fp8.quantize of the routed rows, bit for bit (values near
    448, ties, subnormals, zero and tiny blocks), the send/receive split equal to the
    fused call; rows past the counts zero on these backends."""
    rng = np.random.default_rng(5)
    x = _fp8_edge_rows(rng, Hn, dtype)
    idx = routing(rng, "random")
    args = (x.reshape(R * T, Hn), idx.reshape(R * T, K))
    q, s, cnt, _, _ = _fp8_program(backend, round_scale, False)(*args)
    wq, ws = fp8_lib.quantize(jnp.asarray(x), round_scale=round_scale)
    model_q = np_dispatch(np.asarray(wq).view(np.uint8), idx, E, M)
    model_s = np_dispatch(np.asarray(ws), idx, E, M)
    assert q.dtype == fp8_lib.FP8_DTYPE and s.shape == (R, EL, R * M, Hn // 128)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), model_q["recv"])
    np.testing.assert_array_equal(np.asarray(s), model_s["recv"])
    np.testing.assert_array_equal(np.asarray(cnt), model_q["count"])
    split = _fp8_program(backend, round_scale, True)(*args)
    for a, b in zip(split, (q, s, cnt)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("kind", ["masked", "one_token"])
def test_fp8_dispatch_no_rows_and_one_token(kind):
    """All ids -1 (no rows anywhere) and T = 1: ffi equals the reference bit for bit."""
    rng = np.random.default_rng(6)
    Hn = 128
    mesh = ep_mesh(R)
    x = _fp8_edge_rows(rng, Hn, jnp.bfloat16)
    idx = routing(rng, "masked" if kind == "masked" else "random")
    Tn = T if kind == "masked" else 1
    x, idx = x[:, :Tn], idx[:, :Tn]

    def run(backend):
        def f(x, idx):
            (q, s), cnt, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                         max_tokens_per_rank=M, fp8=True, backend=backend)
            return q[None], s[None], cnt[None], h.src_index[None]

        out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x.reshape(R * Tn, Hn), idx.reshape(R * Tn, K))
        return [np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a)
                for a in out]

    want, got = run("reference"), run("ffi")
    for w_, g_ in zip(want, got):
        np.testing.assert_array_equal(g_, w_)
    if kind == "masked":
        assert (want[2] == 0).all()


def test_fp8_dispatch_is_one_call():
    """ffi lowers an FP8 dispatch to one send and one receive custom call (the cast in the
    send half), not a quantize and two dispatches."""
    mesh = ep_mesh(R)

    def f(x, idx):
        (q, s), cnt, _ = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                     max_tokens_per_rank=M, fp8=True, backend="ffi")
        return q[None], s[None]

    x = jnp.zeros((R * T, 128), jnp.bfloat16)
    idx = jnp.zeros((R * T, K), jnp.int32)
    hlo = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
        x, idx).as_text()
    calls = re.findall(r"custom_call @(jax_ep_\w+)\(", hlo)
    assert calls == ["jax_ep_ll_dispatch_send_fp8", "jax_ep_ll_dispatch_recv_fp8"], calls


# ----------------------------------------------------------------------------- errors

def _single(backend, x, idx, M_=M):
    mesh = ep_mesh(R)

    def f(x, idx):
        recv, cnt, _ = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                   max_tokens_per_rank=M_, backend=backend)
        return recv[None], cnt[None]

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_ids_raise(backend):
    x, idx, _, _ = inputs(6)
    bad = idx.copy()
    bad[2, 4, :2] = [5, 5]  # rank 2's token 4 names expert 5 twice
    with pytest.raises(RUNTIME_ERRORS, match=r"topk_idx\[4\] names expert 5 more than once"):
        jax.block_until_ready(_single(backend, x, bad))
    # Nothing is left waiting: the next call works.
    jax.block_until_ready(_single(backend, x, idx))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_outside_range_raise(backend):
    x, idx, _, _ = inputs(6)
    bad = idx.copy()
    bad[1, 2, 1] = E
    with pytest.raises(RUNTIME_ERRORS, match=rf"topk_idx\[2, 1\] = {E} is outside"):
        jax.block_until_ready(_single(backend, x, bad))


def test_more_tokens_than_M_raises():
    x, idx, _, _ = inputs(7)
    with pytest.raises(ValueError, match=r"T=6 tokens per rank, more than "
                                         r"max_tokens_per_rank=4 \(T > M\)"):
        _single("reference", x, idx, M_=4)


def test_bad_arguments_name_the_argument():
    mesh = ep_mesh(R)
    x, idx, w, _ = inputs(8)

    def call(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x.reshape(-1, H), idx.reshape(-1, K), w.reshape(-1, K))

    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="reference")
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        call(lambda a, i, w_: ll.dispatch(a, i.astype(jnp.int16), **kw)[1])
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible"):
        call(lambda a, i, w_: ll.dispatch(a, i, **dict(kw, num_experts=6))[1])
    with pytest.raises(ValueError, match=r"y must be \[E_local, R \* M, H\]"):
        def bad_y(a, i, w_):
            recv, _, h = ll.dispatch(a, i, **kw)
            return ll.combine(recv[:, :-1], i, w_, h, backend="reference")
        call(bad_y)
    with pytest.raises(TypeError, match="handle must be the LowLatencyHandle"):
        call(lambda a, i, w_: ll.combine(jnp.zeros((EL, R * M, H)), i, w_, None))
    with pytest.raises(ValueError, match=r"fp8=True needs x's hidden size H=16"):
        call(lambda a, i, w_: ll.dispatch(a, i, fp8=True, **kw)[1])


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_numerically(backend):
    mesh = ep_mesh(R)
    x, idx, w, _ = inputs(9, dtype=np.float64)
    x, w = x.astype(np.float32), w.astype(np.float32)
    idx_f = idx.reshape(-1, K)

    def layer(x, w, idx):
        recv, _, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                 max_tokens_per_rank=M, backend=backend)
        return ll.combine(jnp.tanh(recv) * 1.5, idx, w, h, backend=backend)

    g = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    f = jax.jit(lambda x, w: g(x, w, idx_f))
    check_grads(f, (x.reshape(-1, H), w.reshape(-1, K)), order=1, modes=("rev",),
                atol=2e-2, rtol=2e-2, eps=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_model(backend):
    """d x and d weights against closed forms: d x[t] = sum_k w[t, k] * d out[t] (experts
    are identity), d w[t, k] = <d out[t], x[t]>."""
    mesh = ep_mesh(R)
    x, idx, w, _ = inputs(10)
    idx_f = idx.reshape(-1, K)

    def loss(x, w):
        def per(x, w, idx):
            recv, _, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                     max_tokens_per_rank=M, backend=backend)
            return ll.combine(recv, idx, w, h, backend=backend)
        out = jax.shard_map(per, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, w, idx_f)
        return jnp.sum(out * jnp.arange(H, dtype=jnp.float32))

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x.reshape(-1, H), w.reshape(-1, K))
    g = np.broadcast_to(np.arange(H, dtype=np.float32), (R * T, H))
    valid = idx_f >= 0
    want_dx = (w.reshape(-1, K) * valid).sum(1)[:, None] * g
    want_dw = np.where(valid, (g * x.reshape(-1, H)).sum(1)[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-3)


def test_fp8_dispatch_has_no_gradient():
    mesh = ep_mesh(R)
    x = np.ones((R * T, 128), np.float32)
    idx = routing(np.random.default_rng(0), "random").reshape(-1, K)

    def per(x, idx):
        (q, s), _, _ = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                   max_tokens_per_rank=M, fp8=True, backend="reference")
        return jnp.sum(s)[None]

    f = jax.shard_map(per, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(NotImplementedError, match=r"fp8=True\) has no gradient"):
        jax.jit(jax.grad(lambda x: jnp.sum(f(x, idx))))(x)


# ----------------------------------------------------------------------------- overlap

def _lowered_split(backend):
    mesh = ep_mesh(R)
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend=backend)

    def f(x, idx, w, a):
        st = ll.dispatch_send(x, idx, **kw)
        a = jnp.tanh(a @ a)  # independent of the dispatch
        recv, _, h = ll.dispatch_recv(st)
        cst = ll.combine_send(recv, idx, w, h, backend=backend)
        b = jnp.sin(a @ a)  # independent of the combine
        out = ll.combine_recv(cst)
        return out, b

    x, idx, w, _ = inputs(11)
    a = np.ones((R * 32, 32), np.float32)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return g.lower(x.reshape(-1, H), idx.reshape(-1, K), w.reshape(-1, K), a)


def test_lowered_program_has_send_and_recv_with_compute_between():
    lowered = _lowered_split("ffi")
    text = lowered.as_text()
    lines = text.splitlines()
    names = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
    pos = {n: next(i for i, l in enumerate(lines) if f"@jax_ep_ll_{n}(" in l) for n in names}
    dots = [i for i, l in enumerate(lines) if "stablehlo.dot_general" in l]
    assert len(dots) == 2
    assert pos["dispatch_send"] < dots[0] < pos["dispatch_recv"]
    assert pos["combine_send"] < dots[1] < pos["combine_recv"]
    # The compute between reads none of the send halves' results: XLA may run it while
    # the rows are in flight.
    for send, dot in (("dispatch_send", dots[0]), ("combine_send", dots[1])):
        result = lines[pos[send]].split("=")[0].strip().split(":")[0]  # e.g. "%3"
        assert result.startswith("%") and f"{result}#" not in lines[dot], lines[dot]
    # Each receive half takes its send half's results (directly, or through the
    # optimization barriers that keep EP calls in program order, jax_ep._src.ordering; a
    # barrier's result i is its operand i).
    barriers = {}
    for ln in lines:
        if "optimization_barrier" in ln:
            ins = ln.split("optimization_barrier")[1].split(":")[0].split(",")
            barriers[ln.split("=")[0].strip().split(":")[0]] = [a.strip() for a in ins]

    def root(v):
        base, _, k = v.partition("#")
        return root(barriers[base][int(k or 0)]) if base in barriers else v

    for send, recv in (("dispatch_send", "dispatch_recv"), ("combine_send", "combine_recv")):
        result = lines[pos[send]].split("=")[0].strip().split(":")[0]
        call = lines[pos[recv]]
        operands = call.split(f"@jax_ep_ll_{recv}(")[1].split(")")[0]
        assert f"{result}#0" in {root(a.strip()) for a in operands.split(",")}, call
    # The compiled program keeps the two halves as separate calls (nothing merged).
    hlo = lowered.compile().as_text()
    for name in pos:
        assert hlo.count(f'custom_call_target="jax_ep_ll_{name}"') == 1, name


# ----------------------------------------------------------------------------- GPU harness

def _has_gpu():
    try:
        return bool(jax.devices("gpu")) and jax_ep.build_info()["cuda"]
    except RuntimeError:
        return False


import jax_ep  # noqa: E402


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU and the CUDA build")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_cuda_harness_matches_model(dtype):
    """The CUDA kernels, R virtual ranks on one GPU, against the NumPy model."""
    x, idx, w, y = inputs(12, dtype=np.dtype(dtype))
    gpu = jax.devices("gpu")[0]
    on_gpu = lambda *a: [jax.device_put(v, gpu) for v in a]  # noqa: E731
    d = jax.jit(functools.partial(ll.harness_dispatch, num_experts=E, max_tokens_per_rank=M))
    recv, cnt, sr, si, first, rows = jax.tree.map(np.asarray, d(*on_gpu(x, idx)))
    model = np_dispatch(x, idx, E, M)
    for got, key in ((cnt, "count"), (sr, "src_rank"), (si, "src_index"),
                     (first, "first_row"), (rows, "row_count")):
        np.testing.assert_array_equal(got, model[key], err_msg=key)
    np.testing.assert_array_equal(recv.view(np.uint8), model["recv"].view(np.uint8))
    c = jax.jit(functools.partial(ll.harness_combine, num_experts=E, max_tokens_per_rank=M))
    out = np.asarray(c(*on_gpu(y, idx, w, first, rows)))
    np.testing.assert_array_equal(out.view(np.uint8), np_combine(y, idx, w, model).view(np.uint8))


# ----------------------------------------------------------------------------- bench

def test_bench_mode_low_latency_runs(tmp_path):
    from jax_ep.bench import exchange as bench

    out = tmp_path / "ll.json"
    report = bench.main(["--mode", "low_latency", "--ranks", "4", "--tokens", "8",
                         "--hidden", "128", "--topk", "2", "--experts", "8", "--repeats", "1",
                         "--warmup", "0", "--input-sets", "1", "--memcpy-mib", "4",
                         "--backends", "ffi,reference", "--json", str(out)])
    ops = {(r["backend"], r["op"]) for r in report["results"]}
    assert ops == {(b, o) for b in ("ffi", "reference")
                   for o in ("dispatch", "dispatch_fp8", "combine", "roundtrip")}
    # Bytes follow the shape: 4 ranks * 8 tokens * 2 slots rows of 128 bf16.
    disp = next(r for r in report["results"] if r["op"] == "dispatch")
    assert disp["rows_bytes"] == 4 * 8 * 2 * 128 * 2
    assert disp["output_bytes"] == 4 * 2 * 4 * 8 * 128 * 2
    assert report["ffi_roundtrip_over_output_floor"] > 0 and out.exists()
    with pytest.raises(SystemExit):
        bench.main(["--mode", "fast"])
