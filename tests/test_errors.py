"""Bad input gives a clear error naming the argument; a missing peer ends in an error
after JAX_EP_TIMEOUT_S, never a hang."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import BACKENDS, ep_mesh

R, T, K, E, H = 2, 4, 2, 4, 3
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError, RuntimeError)


def _good():
    rng = np.random.default_rng(0)
    return dict(x=rng.standard_normal((R * T, H)).astype(np.float32),
                idx=rng.integers(-1, E, (R * T, K)).astype(np.int32),
                w=rng.random((R * T, K)).astype(np.float32))


def _dispatch(x, idx, w, backend="ffi", in_specs=P("ep"), **kw):
    kw.setdefault("num_experts", E)

    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, axis_name="ep", backend=backend, **kw)
        return rx, h.num_recv[None]

    return jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=in_specs,
                                 out_specs=P("ep")))(x, idx, w)


def _combine(y, backend="ffi", capacity=5):
    g = _good()

    def f(x, idx, w, y):
        _, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                     capacity=capacity, backend=backend)
        return jax_ep.combine(y, h, backend=backend)

    return jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))(
        g["x"], g["idx"], g["w"], y)


# ----------------------------------------------------------------------------- dispatch

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change, exc, pattern", [
    (dict(x=np.zeros((R * T,), np.float32)), ValueError, r"x must be rank 2"),
    (dict(x=np.zeros((R * T, H, 1), np.float32)), ValueError, r"x must be rank 2"),
    (dict(x=np.zeros((R * T, H), np.int32)), TypeError, r"x must be float32"),
    (dict(x=np.zeros((R * T, H), np.float64).astype(np.uint8)), TypeError, r"x must be"),
    (dict(idx=np.zeros((R * T,), np.int32)), ValueError, r"topk_idx must be rank 2"),
    (dict(idx=np.zeros((R * T, K), np.float32)), TypeError, r"topk_idx must be int32"),
    (dict(idx=np.zeros((R * (T + 1), K), np.int32),
          w=np.zeros((R * (T + 1), K), np.float32)), ValueError, r"topk_idx has 5 rows"),
    (dict(w=np.zeros((R * T, K + 1), np.float32)), ValueError, r"topk_weights must have"),
    (dict(w=np.zeros((R * T, K), jnp.bfloat16)), TypeError, r"topk_weights must be float32"),
    (dict(num_experts=3), ValueError, r"num_experts=3 .*divisible"),
    (dict(num_experts=0), ValueError, r"num_experts must be >= 1"),
    (dict(capacity=0), ValueError, r"capacity must be >= 1, got 0"),
    (dict(capacity=-4), ValueError, r"capacity must be >= 1"),
    (dict(capacity=2.5), TypeError, r"capacity must be a static Python int"),
], ids=lambda v: None)
def test_dispatch_bad_arguments(backend, change, exc, pattern):
    args = _good()
    kw = {k: v for k, v in change.items() if k not in args}
    args.update({k: v for k, v in change.items() if k in args})
    with pytest.raises(exc, match=pattern):
        _dispatch(args["x"], args["idx"], args["w"], backend=backend, **kw)


def test_bad_backend_name():
    g = _good()
    with pytest.raises(ValueError, match=r"backend must be one of .*'cuda'"):
        _dispatch(g["x"], g["idx"], g["w"], backend="cuda")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        jax_ep.get_dispatch_layout(g["idx"], num_experts=E, num_ranks=R, backend="gpu!")


def test_unbound_axis_name():
    g = _good()

    def f(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="nope")[0]

    with pytest.raises(NameError, match=r"axis_name 'nope'"):
        jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))(
            g["x"], g["idx"], g["w"])


@pytest.mark.parametrize("bad", [E, 99, -2, -(2**31)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_outside_range_raise_with_the_value(backend, bad):
    g = _good()
    idx = g["idx"].copy()
    idx[T + 2, 1] = bad  # rank 1's token 2, slot 1: only one rank sees a bad id
    with pytest.raises(RUNTIME_ERRORS, match=rf"topk_idx\[2, 1\] = {bad} is outside "
                                             rf"\[-1, {E}\)"):
        jax.block_until_ready(_dispatch(g["x"], idx, g["w"], backend=backend))
    # The program still works afterwards (no rank is left waiting).
    jax.block_until_ready(_dispatch(g["x"], g["idx"], g["w"], backend=backend))


# ----------------------------------------------------------------------------- combine

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("y, exc, pattern", [
    (np.zeros((R * 5,), np.float32), ValueError, r"y must be rank 2"),
    (np.zeros((R * 5, H), np.int32), TypeError, r"y must be float32"),
    (np.zeros((R * 8, H), np.float32), ValueError, r"y must have the handle's capacity 5"),
], ids=["rank", "dtype", "capacity"])
def test_combine_bad_y(backend, y, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _combine(y, backend=backend, capacity=5)


def test_combine_handle_of_wrong_capacity():
    """A handle from a dispatch with capacity 6 cannot combine rows of capacity 5."""
    g = _good()

    def f(x, idx, w):
        rx, _, _, h5 = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", capacity=5)
        _, _, _, h6 = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", capacity=6)
        return jax_ep.combine(rx, h6)

    with pytest.raises(ValueError, match=r"capacity 6 rows, got shape \(5, 3\)"):
        jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))(
            g["x"], g["idx"], g["w"])


def test_combine_handle_not_a_handle():
    def f(y):
        return jax_ep.combine(y, {"num_recv": 1})

    with pytest.raises(TypeError, match=r"handle must be the DispatchHandle"):
        jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))(
            np.zeros((R * 5, H), np.float32))


# ----------------------------------------------------------------------------- layout

@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_bad_arguments(backend):
    idx = np.zeros((T, K), np.int32)
    with pytest.raises(ValueError, match=r"num_ranks must be >= 1"):
        jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=0, backend=backend)
    with pytest.raises(ValueError, match=r"num_experts=4 .*divisible .*R=3"):
        jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=3, backend=backend)
    with pytest.raises(ValueError, match=r"topk_idx must be rank 2"):
        jax_ep.get_dispatch_layout(idx[0], num_experts=E, num_ranks=R, backend=backend)
    with pytest.raises(TypeError, match=r"topk_idx must be int32"):
        jax_ep.get_dispatch_layout(idx.astype(np.float32), num_experts=E, num_ranks=R,
                                   backend=backend)
    bad = idx.copy()
    bad[3, 0] = 7
    with pytest.raises(RUNTIME_ERRORS, match=r"topk_idx\[3, 0\] = 7 is outside \[-1, 4\)"):
        jax.block_until_ready(jax_ep.get_dispatch_layout(bad, num_experts=E, num_ranks=R,
                                                         backend=backend))


# ----------------------------------------------------------------------------- timeout

def test_missing_peer_times_out(monkeypatch):
    """The raw dispatch target on one device, told there are 2 ranks: rank 1 never comes.
    It must fail after JAX_EP_TIMEOUT_S (read at each call) with a message naming the
    missing rank, not hang."""
    jax_ep.resolve_backend("ffi")  # registers the targets
    jax_ep.config.update("timeout_s", "2")
    Tn, Hn, Kn, C = 3, 2, 2, 6
    out_types = (jax.ShapeDtypeStruct((C, Hn), jnp.float32),
                 jax.ShapeDtypeStruct((C, Kn), jnp.int32),
                 jax.ShapeDtypeStruct((C, Kn), jnp.float32),
                 jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                 jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((C,), jnp.int32),
                 jax.ShapeDtypeStruct((C,), jnp.int32),
                 jax.ShapeDtypeStruct((Tn, 2), jnp.int32))
    call = jax.ffi.ffi_call("jax_ep_dispatch", out_types)
    f = jax.jit(lambda x, i, w, r, g: call(x, i, w, r, g, num_experts=np.int64(4),
                                           num_ranks=np.int64(2), capacity=np.int64(C),
                                           call_site=np.int64(2**40 + 17)))
    args = (np.ones((Tn, Hn), np.float32), np.zeros((Tn, Kn), np.int32),
            np.ones((Tn, Kn), np.float32), np.int32(0), np.int32(0))
    t0 = time.monotonic()
    with pytest.raises(RUNTIME_ERRORS, match=r"only 1 of 2 ranks arrived \(missing: 1\)"):
        jax.block_until_ready(f(*args))
    elapsed = time.monotonic() - t0
    assert 1.5 < elapsed < 60, elapsed


# ----------------------------------------------------------------------------- pipelining

_PIPELINE = r"""
import sys
import numpy as np
import jax_ep  # first: sizes XLA's CPU pool before JAX creates its client
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
def body(x, i, w):
    rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=16, axis_name="ep", backend="ffi")
    return jax_ep.combine(rx, h, backend="ffi")
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
rng = np.random.default_rng(0)
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
x = put(rng.standard_normal((128, 64)).astype(np.float32))
i = put(rng.integers(0, 16, (128, 2)).astype(np.int32))
w = put(np.ones((128, 2), np.float32))
want = np.asarray(f(x, i, w))
outs = [f(x, i, w) for _ in range(int(sys.argv[1]))]  # no waiting in between
bad = sum(not np.array_equal(np.asarray(o), want) for o in outs)
print("DONE", len(outs), "mismatches", bad)
"""


def _run_pipeline(env_extra, calls, timeout):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", **env_extra)
    return subprocess.run([sys.executable, "-c", _PIPELINE, str(calls)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_pipelined_calls_complete():
    """256 back-to-back calls of one jitted dispatch+combine on 8 CPU devices, never
    waiting in between (JAX's asynchronous dispatch). XLA parks a pool thread per device
    whose in-flight queue is full; on a pool of one thread per device (2 cores) that left
    a round without the thread its last rank needed, and the loop never finished. jax_ep
    sizes the pool (2 threads per device) when imported before JAX's CPU client exists."""
    r = _run_pipeline({"JAX_EP_TIMEOUT_S": "20"}, 256, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DONE 256 mismatches 0" in r.stdout, r.stdout + r.stderr[-2000:]


def test_small_pool_warns():
    """With the pool pinned to one thread per device (NPROC set by the user) jax_ep
    cannot resize it: it warns at trace time, naming the remedy."""
    r = _run_pipeline({"JAX_EP_TIMEOUT_S": "20", "NPROC": "8"}, 4, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "XLA's CPU thread pool has 8 threads for 8 devices" in r.stderr, r.stderr[-3000:]
    assert "Set NPROC to at least 16" in r.stderr, r.stderr[-3000:]
